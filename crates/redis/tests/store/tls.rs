//! `rediss://`: a `redis-server` of the test's own serving TLS with a certificate the test
//! makes, and an ACL user. The store admits over it with the CA given; without it (Mozilla's
//! roots only) or with a wrong password it refuses to connect, so nothing is ever sent in the
//! clear or to a server that was not verified.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use tollgate_core::{Decision, Store, pipeline::plan};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_testkit::redis_server::RedisServer;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct TlsRedis {
    _server: RedisServer,
    tls_port: u16,
    ca: Vec<u8>,
    _dir: tempfile_dir::Dir,
}

mod tempfile_dir {
    /// A directory removed when dropped.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A certificate for 127.0.0.1 in a directory of its own: (directory, PEM, cert file, key file).
fn certificate(name: &str) -> (tempfile_dir::Dir, Vec<u8>, String, String) {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "tollgate-{name}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (crt, key) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&crt, cert.pem()).unwrap();
    std::fs::write(&key, signing_key.serialize_pem()).unwrap();
    let path = |p: std::path::PathBuf| p.to_str().unwrap().to_owned();
    (
        tempfile_dir::Dir(dir),
        cert.pem().into_bytes(),
        path(crt),
        path(key),
    )
}

/// The server side of TLS on `port`, with the test's certificate, clients not authenticated.
fn tls_args(port: u16, crt: &str, key: &str) -> Vec<String> {
    [
        "--tls-port",
        &port.to_string(),
        "--tls-cert-file",
        crt,
        "--tls-key-file",
        key,
        "--tls-ca-cert-file",
        crt,
        "--tls-auth-clients",
        "no",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn start() -> TlsRedis {
    let (dir, ca, crt, key) = certificate("tls-redis");
    let tls_port = free_port();
    let mut args = tls_args(tls_port, &crt, &key);
    args.extend(
        [
            "--user",
            "gate",
            "on",
            ">s3cret-password",
            "~*",
            "&*",
            "+@all",
        ]
        .map(str::to_owned),
    );
    let server = RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    TlsRedis {
        _server: server,
        tls_port,
        ca,
        _dir: dir,
    }
}

fn config(url: String, ca: Option<Vec<u8>>) -> RedisConfig {
    let mut c = RedisConfig::new(url);
    c.initialise_on_first_use = true;
    c.prefix = "tls".into();
    c.call_timeout = Duration::from_secs(2);
    c.ca_pem = ca;
    c
}

async fn admits(store: &RedisStore, id: &str) -> Result<Decision, tollgate_core::StoreError> {
    let policy = tollgate_testkit::policy(
        "[[scopes]]\nkey = \"user\"\nbudget = { tokens = 1000, period = \"day\" }\n",
    );
    let p = plan(&policy, &tollgate_testkit::facts(id, "u1", 10, 10)).unwrap();
    store.admit(&p).await
}

#[tokio::test]
async fn a_verified_tls_connection_with_an_acl_user_admits() {
    let r = start();
    // The user and password from the URL.
    let url = format!("rediss://gate:s3cret-password@127.0.0.1:{}/", r.tls_port);
    let store = RedisStore::connect(config(url, Some(r.ca.clone())))
        .await
        .unwrap();
    assert!(matches!(
        admits(&store, "t1").await.unwrap(),
        Decision::Admit(_)
    ));
    let policy = tollgate_testkit::policy(
        "[[scopes]]\nkey = \"user\"\nbudget = { tokens = 1000, period = \"day\" }\n",
    );
    let p = plan(&policy, &tollgate_testkit::facts("t0", "u1", 10, 10)).unwrap();
    let scope = p.reserves().next().unwrap().1.scope.id();
    let day = Some(tollgate_core::Period::Fixed(86_400_000));
    assert_eq!(store.usage(scope, day).await.unwrap().reserved, 20);

    // The same from the configuration, over a URL without them.
    let mut c = config(
        format!("rediss://127.0.0.1:{}/", r.tls_port),
        Some(r.ca.clone()),
    );
    c.username = Some("gate".into());
    c.password = Some("s3cret-password".into());
    let store = RedisStore::connect(c).await.unwrap();
    assert!(matches!(
        admits(&store, "t2").await.unwrap(),
        Decision::Admit(_)
    ));
    // Nothing of the password in what the configuration shows.
    let shown = format!(
        "{:?}",
        config(
            format!("rediss://gate:s3cret-password@127.0.0.1:{}/", r.tls_port),
            None
        )
    );
    assert!(!shown.contains("s3cret"), "{shown}");
}

#[tokio::test]
async fn an_unverified_server_or_a_wrong_password_is_refused() {
    let r = start();
    // Mozilla's roots do not vouch for the test's certificate.
    let url = format!("rediss://gate:s3cret-password@127.0.0.1:{}/", r.tls_port);
    let store = RedisStore::connect(config(url, None)).await.unwrap();
    let e = admits(&store, "u1").await.unwrap_err();
    assert!(
        matches!(e, tollgate_core::StoreError::Unavailable(_)),
        "{e:?}"
    );
    // A wrong password, over a verified connection.
    let url = format!("rediss://gate:wrong@127.0.0.1:{}/", r.tls_port);
    let store = RedisStore::connect(config(url, Some(r.ca.clone())))
        .await
        .unwrap();
    let e = admits(&store, "u2").await.unwrap_err();
    assert!(
        matches!(e, tollgate_core::StoreError::Unavailable(_)),
        "{e:?}"
    );
    assert!(
        !e.to_string().contains("wrong"),
        "the password is not in the error: {e}"
    );
}

/// Three cluster nodes serving clients and their bus over TLS (`tls-cluster`), joined by
/// `redis-cli --tls`: the store given their `rediss://` URLs and the CA admits on every node's
/// slots; without the CA it reaches none.
#[tokio::test]
async fn a_tls_cluster_admits_with_its_ca_and_refuses_without() {
    let (dir, ca, crt, key) = certificate("tls-cluster");
    let mut nodes = Vec::new();
    let mut tls_ports = Vec::new();
    for i in 0..3 {
        let node_dir = dir.0.join(format!("n{i}"));
        std::fs::create_dir_all(&node_dir).unwrap();
        let tls_port = free_port();
        let mut args = tls_args(tls_port, &crt, &key);
        args.extend(["--tls-cluster", "yes"].map(str::to_owned));
        nodes.push(RedisServer::start_tcp_with(
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                "--dir",
                node_dir.to_str().unwrap(),
            ]
            .into_iter()
            .chain(args.iter().map(String::as_str))
            .collect::<Vec<_>>(),
        ));
        tls_ports.push(tls_port);
    }
    let addrs: Vec<String> = tls_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let out = std::process::Command::new("redis-cli")
        .args(["--tls", "--cacert", &crt, "--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for n in &nodes {
        tollgate_testkit::wait::until_blocking(
            "the cluster ready",
            Duration::from_secs(20),
            || {
                let info = n.cli().args(["CLUSTER", "INFO"]).output().unwrap();
                String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok")
            },
        );
    }
    let urls: Vec<String> = tls_ports
        .iter()
        .map(|p| format!("rediss://127.0.0.1:{p}/"))
        .collect();
    let cluster = |ca: Option<Vec<u8>>| {
        let mut c = config(urls[0].clone(), ca);
        c.cluster = Some(urls.clone());
        c.shards = 3;
        c
    };
    let store = RedisStore::connect(cluster(Some(ca))).await.unwrap();
    // Users whose keys hash to different shards, so that more than one node answers.
    let policy = tollgate_testkit::policy(
        "[[scopes]]\nkey = \"user\"\nbudget = { tokens = 1000, period = \"day\" }\n",
    );
    let mut shards = std::collections::HashSet::new();
    for i in 0..12 {
        let p = plan(
            &policy,
            &tollgate_testkit::facts(&format!("c{i}"), &format!("u{i}"), 10, 10),
        )
        .unwrap();
        assert!(
            matches!(store.admit(&p).await.unwrap(), Decision::Admit(_)),
            "request {i}"
        );
        shards.insert(
            store
                .shard_prefix(p.reserves().next().unwrap().1.scope.id())
                .to_owned(),
        );
    }
    assert!(shards.len() > 1, "{shards:?}");
    assert!(RedisStore::connect(cluster(None)).await.is_err());
}
