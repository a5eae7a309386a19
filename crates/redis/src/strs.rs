//! A script call's KEYS or ARGV, in order, with helpers that write numbers, flags and keys the
//! way the scripts read them.

use std::fmt;

use compact_str::CompactString;

/// The strings, in order. Most are numbers, flags or names of a few bytes, kept inline.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Strs {
    items: Vec<CompactString>,
}

impl Strs {
    /// Room for `items` strings.
    pub fn with_capacity(items: usize) -> Self {
        Self {
            items: Vec::with_capacity(items),
        }
    }

    /// Appends `s`.
    pub fn push(&mut self, s: &str) {
        self.items.push(CompactString::new(s));
    }

    /// Appends a number.
    pub fn push_num(&mut self, n: impl itoa::Integer) {
        self.push(itoa::Buffer::new().format(n));
    }

    /// Appends `0` or `1`.
    pub fn push_flag(&mut self, on: bool) {
        self.push(if on { "1" } else { "0" });
    }

    /// Appends the key `{prefix}:{kind}:{id}`.
    pub fn push_key(&mut self, prefix: &str, kind: &str, id: &str) {
        // Made as a `String`, whose buffer a long key keeps (pushing parts into a
        // `CompactString` on the heap costs more).
        self.items.push(CompactString::from(key(prefix, kind, id)));
    }

    /// How many strings.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The `i`-th string.
    pub fn get(&self, i: usize) -> Option<&str> {
        self.items.get(i).map(CompactString::as_str)
    }

    /// The strings, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.items.iter().map(CompactString::as_str)
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

/// `{prefix}:{kind}:{id}`, made in one allocation of the right size: every per-request and
/// per-scope key (`docs/redis.md` lists the kinds) is made here.
pub(crate) fn key(prefix: &str, kind: &str, id: &str) -> String {
    let mut k = String::with_capacity(prefix.len() + kind.len() + id.len() + 2);
    for part in [prefix, ":", kind, ":", id] {
        k.push_str(part);
    }
    k
}

#[cfg(test)]
mod tests {
    use super::Strs;

    #[test]
    fn strings_come_back_as_pushed() {
        let mut s = Strs::with_capacity(1);
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
