//! `tollgate admin` against a running `tollgate serve`: status, usage, kill and lift, reload,
//! as tables and as JSON; a wrong token and an unreachable gateway are clear errors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use std::process::Command;

use serde_json::Value;
use tollgate_sim::{Sim, SimConfig};

use common::start_instance_with;

const TOKEN: &str = "admin-cli-token-0123456789";

/// `tollgate admin --url URL ARGS` with `token` in `TOLLGATE_ADMIN_TOKEN`: (exit code, stdout,
/// stderr).
fn admin(url: &str, token: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["admin", "--url", url])
        .args(args)
        .env("TOLLGATE_ADMIN_TOKEN", token)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_of(url: &str, args: &[&str]) -> Value {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    let (code, out, err) = admin(url, TOKEN, &all);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_cli_reads_and_switches_a_running_gateway() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let (dir, token_file) = common::admin_token_file(TOKEN);
    let config = dir.path().join("gateway.toml");
    let text = |version: &str| {
        format!(
            "{}[[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n\
             [policy]\nversion = \"{version}\"\n[[policy.scopes]]\nkey = \"tenant\"\n\
             requests = {{ limit = 60, window = \"1m\" }}\n\
             budget = {{ tokens = 5000, period = \"day\" }}\n",
            common::admin_head(&token_file, &sim.base_url()),
            tollgate_gateway::hash_key("sk-acme"),
        )
    };
    std::fs::write(&config, text("v1")).unwrap();
    let (_gateway, mut urls) = start_instance_with(&config, &["admin"]);
    let url = urls.remove(1);

    let status = json_of(&url, &["status"]);
    assert_eq!(status["policy_version"], "v1");
    assert_eq!(status["store"], "ok");
    assert_eq!(status["rules"][0]["name"], "tenant");
    assert_eq!(
        status["rules"][0]["controls"],
        serde_json::json!(["requests", "budget"])
    );
    let (code, table, _) = admin(&url, TOKEN, &["status"]);
    assert_eq!(code, 0);
    assert!(table.contains("policy version   v1"), "{table}");
    assert!(table.contains("kill switches: none"), "{table}");

    let usage = json_of(&url, &["usage", "--scope", "tenant|tenant:acme"]);
    assert_eq!(usage["budget"]["limit"], 5000);
    assert_eq!(usage["settled"], 0);
    // The table says each number with its unit, and the reset in words and as an instant.
    let (code, table, _) = admin(&url, TOKEN, &["usage", "--scope", "tenant|tenant:acme"]);
    assert_eq!(code, 0);
    assert!(table.contains("budget limit      5,000 tokens"), "{table}");
    assert!(
        table.contains("budget resets     in ") && table.contains("Z)"),
        "{table}"
    );
    assert!(!table.contains(" ms "), "{table}");
    // A rule's name alone, for a rule keyed on the tenant, is refused with what to give; a
    // misspelt rule lists the close ones.
    let (code, _, err) = admin(&url, TOKEN, &["usage", "--scope", "tenant"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("scope_needs_key") && err.contains("tenant|"),
        "{err}"
    );
    let (code, _, err) = admin(&url, TOKEN, &["usage", "--scope", "tenat|tenant:acme"]);
    assert_eq!(code, 1);
    assert!(err.contains("Did you mean tenant?"), "{err}");
    // The admin URL from the environment.
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["admin", "status"])
        .env("TOLLGATE_ADMIN_URL", &url)
        .env("TOLLGATE_ADMIN_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (code, out, err) = admin(
        &url,
        TOKEN,
        &["kill", "tenant:acme", "--reason", "incident 12"],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "tenant:acme switched off");
    let status = json_of(&url, &["status"]);
    assert_eq!(status["kills"][0]["target"], "tenant:acme");
    assert_eq!(status["kills"][0]["reason"], "incident 12");
    let (code, out, _) = admin(&url, TOKEN, &["lift", "tenant:acme"]);
    assert_eq!((code, out.trim()), (0, "tenant:acme switched on again"));
    assert_eq!(json_of(&url, &["status"])["kills"], serde_json::json!([]));

    std::fs::write(&config, text("v2")).unwrap();
    let (code, out, _) = admin(&url, TOKEN, &["reload"]);
    assert_eq!((code, out.trim()), (0, "reloaded: policy version v2"));

    // Errors say what went wrong, with exit codes apart.
    let (code, _, err) = admin(&url, "wrong-token-0123456789", &["status"]);
    assert_eq!(code, 1);
    assert!(err.contains("401"), "{err}");
    let (code, _, err) = admin(&url, TOKEN, &["kill", "everything", "--reason", "x"]);
    assert_eq!(code, 1);
    assert!(err.contains("400"), "{err}");
    let (code, _, err) = admin("http://127.0.0.1:1", TOKEN, &["status"]);
    assert_eq!(code, 2);
    assert!(err.contains("could not reach"), "{err}");
}

/// A kill switch of the configuration file shows wherever kill switches are listed, with its
/// origin; lifting it is refused naming the file, and lifting a target nothing switches off is
/// a 404; neither sends an alert nor exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switches_of_the_file_are_shown_and_not_lifted_from_outside() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let (dir, token_file) = common::admin_token_file(TOKEN);
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n\
             [[kill]]\ntarget = \"tenant:acme\"\nreason = \"invoice unpaid\"\n\
             [[upstreams]]\nname = \"sim\"\nbase_url = \"{}\"\nmodels = [\"gpt-4o\"]\n\
             [[keys]]\nhash = \"{}\"\ntenant = \"acme\"\n[policy]\n",
            token_file.display(),
            sim.base_url(),
            tollgate_gateway::hash_key("sk-acme"),
        ),
    )
    .unwrap();
    let (_gateway, mut urls) = start_instance_with(&config, &["admin"]);
    let url = urls.remove(1);

    let status = json_of(&url, &["status"]);
    assert_eq!(status["kills"][0]["target"], "tenant:acme");
    assert_eq!(status["kills"][0]["origin"], "configuration");
    assert_eq!(status["kills"][0]["file"], config.display().to_string());
    let (code, table, _) = admin(&url, TOKEN, &["status"]);
    assert_eq!(code, 0);
    assert!(
        table.contains("tenant:acme") && table.contains("set in "),
        "{table}"
    );
    assert!(!table.contains("kill switches: none"), "{table}");

    let (code, _, err) = admin(&url, TOKEN, &["lift", "tenant:acme"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("409 kill_switch_in_configuration"), "{err}");
    assert!(err.contains(&config.display().to_string()), "{err}");
    let (code, _, err) = admin(&url, TOKEN, &["lift", "tenant:other"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("404 kill_switch_not_set"), "{err}");
    // Still switched off.
    assert_eq!(
        json_of(&url, &["status"])["kills"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// `tollgate admin keys`: a key issued from the shell works at once, shows its secret once,
/// lists without it, rotates and is revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_issued_rotated_and_revoked_from_the_shell() {
    let sim = Sim::start(SimConfig::default()).await.unwrap();
    let (dir, token_file) = common::admin_token_file(TOKEN);
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "{}[policy]\n[[policy.scopes]]\nkey = \"tenant\"\n\
             requests = {{ limit = 60, window = \"1m\" }}\n",
            common::admin_head(&token_file, &sim.base_url()),
        ),
    )
    .unwrap();
    let (_gateway, urls) = start_instance_with(&config, &["admin"]);
    let (url, admin_url) = (&urls[0], &urls[1]);
    let (code, out, err) = admin(
        admin_url,
        TOKEN,
        &[
            "keys",
            "create",
            "--tenant",
            "acme",
            "--expires-in",
            "30d",
            "--meta",
            "team=search",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("shown this once"), "{out}");
    let field = |out: &str, name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .trim()
            .to_owned()
    };
    let (id, secret) = (field(&out, "id"), field(&out, "secret"));
    let chat = |secret: String| {
        let url = url.clone();
        async move {
            let req = hyper::Request::post(format!("{url}/v1/chat/completions"))
                .header("authorization", format!("Bearer {secret}"))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    r#"{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
                )))
                .unwrap();
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>()
                .request(req)
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(chat(secret.clone()).await, 200);
    let (code, listed, _) = admin(admin_url, TOKEN, &["keys", "list"]);
    assert_eq!(code, 0);
    assert!(
        listed.contains(&id) && listed.contains("acme") && !listed.contains(&secret),
        "{listed}"
    );
    let (code, out, err) = admin(admin_url, TOKEN, &["keys", "rotate", &id, "--grace", "0s"]);
    assert_eq!(code, 0, "{err}");
    let fresh = field(&out, "secret");
    assert_eq!(chat(fresh.clone()).await, 200);
    assert_eq!(chat(secret).await, 401);
    // A limit for one value, set and cleared from the shell.
    let (code, out, err) = admin(
        admin_url,
        TOKEN,
        &["limit", "set", "tenant:acme", "requests", "30"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("30 requests per 1m (the rule's own: 60 requests per 1m)"),
        "{out}"
    );
    let (_, listed, _) = admin(admin_url, TOKEN, &["limit", "list"]);
    assert!(
        listed.contains("tenant|tenant:acme") && listed.contains("30 requests per 1m"),
        "{listed}"
    );
    let (code, out, _) = admin(
        admin_url,
        TOKEN,
        &["limit", "clear", "tenant:acme", "requests"],
    );
    assert_eq!(code, 0);
    assert!(out.contains("the rule's own limit again"), "{out}");
    let (code, _, err) = admin(
        admin_url,
        TOKEN,
        &["limit", "set", "tenant:acme", "budget", "5"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("no rule keyed"), "{err}");
    let (code, out, _) = admin(admin_url, TOKEN, &["keys", "revoke", &id]);
    assert_eq!((code, out.trim()), (0, format!("{id} revoked").as_str()));
    assert_eq!(chat(fresh).await, 401);
    // Revoked for good: again, the same answer; a rotation is refused.
    let (code, out, _) = admin(admin_url, TOKEN, &["keys", "revoke", &id]);
    assert_eq!((code, out.trim()), (0, format!("{id} revoked").as_str()));
    let (code, _, err) = admin(admin_url, TOKEN, &["keys", "rotate", &id]);
    assert_eq!(code, 1);
    assert!(
        err.contains("key_changed") && err.contains("revoked"),
        "{err}"
    );
    let (code, _, err) = admin(admin_url, TOKEN, &["keys", "revoke", "vk_0000000000000000"]);
    assert_eq!(code, 1);
    assert!(err.contains("key_not_found"), "{err}");
}
