//! A script call's KEYS or ARGV: strings kept end to end in one buffer, so that each one pushed
//! costs no allocation of its own. An admission has some forty of them and a settlement ten;
//! kept as a `String` each, their allocations and frees were the largest part of making a call.

use std::fmt;

/// Strings in one buffer, in order.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Strs {
    text: String,
    ends: Vec<usize>,
}

impl Strs {
    /// Room for `items` strings of `bytes` in all.
    pub fn with_capacity(items: usize, bytes: usize) -> Self {
        Self {
            text: String::with_capacity(bytes),
            ends: Vec::with_capacity(items),
        }
    }

    /// Appends `s`.
    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    /// Appends a number, written by `itoa` (the formatting machinery of `to_string` costs
    /// several times as much per number).
    pub fn push_num(&mut self, n: impl itoa::Integer) {
        self.push(itoa::Buffer::new().format(n));
    }

    /// Appends `0` or `1`.
    pub fn push_flag(&mut self, on: bool) {
        self.push(if on { "1" } else { "0" });
    }

    /// Appends the key `{prefix}:{kind}:{id}`.
    pub fn push_key(&mut self, prefix: &str, kind: &str, id: &str) {
        crate::encode::write_key(&mut self.text, prefix, kind, id);
        self.ends.push(self.text.len());
    }

    /// How many strings.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The `i`-th string.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = match i {
            0 => 0,
            _ => *self.ends.get(i - 1)?,
        };
        self.text.get(start..end)
    }

    /// The strings, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.ends.len()).map(|i| self.get(i).unwrap_or_default())
    }

    /// The strings, borrowed, in a vector (tests and callers that slice them).
    pub fn to_vec(&self) -> Vec<&str> {
        self.iter().collect()
    }
}

impl<'a> Extend<&'a str> for Strs {
    fn extend<I: IntoIterator<Item = &'a str>>(&mut self, iter: I) {
        for s in iter {
            self.push(s);
        }
    }
}

impl<'a> FromIterator<&'a str> for Strs {
    fn from_iter<I: IntoIterator<Item = &'a str>>(iter: I) -> Self {
        let mut s = Self::default();
        s.extend(iter);
        s
    }
}

impl<const N: usize> PartialEq<[&str; N]> for Strs {
    fn eq(&self, other: &[&str; N]) -> bool {
        self.iter().eq(other.iter().copied())
    }
}

impl fmt::Debug for Strs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::Strs;

    #[test]
    fn strings_come_back_as_pushed() {
        let mut s = Strs::with_capacity(1, 1);
        assert!(s.is_empty());
        s.push("");
        s.push_num(u64::MAX);
        s.push_flag(true);
        s.push_key("tg", "ts", "req-1");
        s.push("ü");
        s.extend(["", "x"]);
        assert_eq!(
            s,
            ["", "18446744073709551615", "1", "tg:ts:req-1", "ü", "", "x"]
        );
        assert_eq!(s.len(), 7);
        assert_eq!(s.get(3), Some("tg:ts:req-1"));
        assert_eq!(s.get(7), None);
        assert_ne!(s, ["", "18446744073709551615"]);
        assert_eq!(format!("{s:?}"), format!("{:?}", s.to_vec()));
        assert_eq!(s.iter().collect::<Strs>(), s);
    }
}
