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
