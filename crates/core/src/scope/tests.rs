use super::*;

#[test]
fn keys_name_rule_and_dimensions() {
    let id = Identity::default()
        .with(Dimension::Tenant, "acme")
        .with(Dimension::Model, "gpt-4o");
    let k = ScopeKey::derive("tm", &[Dimension::Tenant, Dimension::Model], &id);
    let k = k.unwrap_or_else(|| unreachable!());
    assert_eq!(k.id(), "tm|tenant:acme/model:gpt-4o");
    assert_eq!(k.rule(), "tm");
    assert_eq!(k.key(), "tenant:acme/model:gpt-4o");
    let g = ScopeKey::derive("all", &[], &id).unwrap_or_else(|| unreachable!());
    assert_eq!(g.key(), "global");
}

#[test]
fn missing_dimension_means_no_scope() {
    let id = Identity::default().with(Dimension::Tenant, "acme");
    assert!(ScopeKey::derive("u", &[Dimension::User], &id).is_none());
}

#[test]
fn hostile_values_cannot_forge_another_scope() {
    let evil = Identity::default().with(Dimension::User, "a/model:x");
    let k = ScopeKey::derive("u", &[Dimension::User], &evil).unwrap_or_else(|| unreachable!());
    assert_eq!(k.key(), "user:a%2Fmodel%3Ax");
    let tag = Identity::default().with(Dimension::User, "{slot}|x");
    let k = ScopeKey::derive("u", &[Dimension::User], &tag).unwrap_or_else(|| unreachable!());
    assert!(!k.id()[2..].contains(['{', '}', '|']));
}

#[test]
fn addresses_are_grouped_by_network() {
    let p = IpPrefix::default();
    let ip = |s: &str| s.parse().unwrap_or_else(|_| unreachable!());
    assert_eq!(p.network(ip("10.1.2.3")), "10.1.2.3");
    assert_eq!(p.network(ip("2001:db8:1:2:3:4:5:6")), "2001:db8:1:2::/64");
    // An IPv4 client on a dual-stack socket is its IPv4 address.
    assert_eq!(p.network(ip("::ffff:10.1.2.3")), "10.1.2.3");
    let wide = IpPrefix { v4: 24, v6: 48 };
    assert_eq!(wide.network(ip("10.1.2.3")), "10.1.2.0/24");
    assert_eq!(wide.network(ip("2001:db8:1:2::9")), "2001:db8:1::/48");
    let id = Identity::default().with(Dimension::Ip, "2001:db8:1:2::9");
    let k = ScopeKey::derive("i", &[Dimension::Ip], &id).unwrap_or_else(|| unreachable!());
    assert_eq!(k.key(), "ip:2001:db8:1:2::/64");
}

#[test]
fn escaping_is_injective_and_users_sit_in_their_tenant() {
    let key = |u: &str| {
        let id = Identity::default()
            .with(Dimension::Tenant, "acme")
            .with(Dimension::User, u);
        ScopeKey::derive("u", &[Dimension::User], &id)
            .unwrap_or_else(|| unreachable!())
            .key()
            .to_owned()
    };
    assert_eq!(key("carol?"), "tenant:acme/user:carol%3F");
    assert_eq!(key("carol\u{1}"), "tenant:acme/user:carol%01");
    assert_ne!(key("carol\u{1}"), key("carol\u{2}"));
}

proptest::proptest! {
    /// A key renamed is the key derived under the other rule: same dimensions, same grouping,
    /// whatever the values (hostile ones included) and whichever dimensions are known.
    #[test]
    fn a_renamed_key_is_the_key_derived_under_the_other_rule(
        values in proptest::collection::vec(proptest::option::of("[a-z0-9:/|%?{}\u{1}é]{0,12}"), 6),
        ip in proptest::option::of(proptest::prop_oneof![
            proptest::strategy::Just("203.0.113.7".to_owned()),
            proptest::strategy::Just("2001:db8::1".to_owned()),
            "[0-9a-f.:]{0,10}",
        ]),
        picked in proptest::collection::vec(proptest::bool::ANY, 6),
        v6 in 1u8..=128,
    ) {
        let mut id = Identity::default();
        for (d, v) in Dimension::ALL.into_iter().zip(&values) {
            if let Some(v) = v {
                id = id.with(d, v.as_str());
            }
        }
        if let Some(ip) = ip {
            id = id.with(Dimension::Ip, ip);
        }
        let dims: Vec<Dimension> = Dimension::ALL
            .into_iter()
            .zip(&picked)
            .filter_map(|(d, on)| on.then_some(d))
            .collect();
        let prefix = IpPrefix { v4: 24, v6 };
        let first = ScopeKey::derive_in("enforced", &dims, &id, prefix);
        let second = ScopeKey::derive_in("per-key-trial", &dims, &id, prefix);
        proptest::prop_assert_eq!(first.map(|k| k.renamed("per-key-trial")), second.clone());
        if let Some(k) = second {
            let renamed = k.renamed("x");
            proptest::prop_assert_eq!(renamed.rule(), "x");
            proptest::prop_assert_eq!(renamed.key(), k.key());
            // A child's tag is not carried over.
            proptest::prop_assert_eq!(k.child("calls").renamed("x"), renamed);
        }
    }
}
