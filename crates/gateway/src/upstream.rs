//! The client of one upstream: its own connection pool and, for `https://`, its own trust
//! anchors (Mozilla's roots compiled in, or the CA certificates of the upstream's `ca_file`).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// An upstream's HTTP client (cheap to clone: clones share the pool).
#[derive(Clone)]
pub struct UpstreamClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// Where its trust anchors came from, for `Debug`.
    roots: String,
}

impl fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

impl UpstreamClient {
    /// A client that speaks plain HTTP and HTTPS. HTTPS servers are trusted if their chain ends
    /// in one of Mozilla's roots or, with `ca_file`, in one of the PEM certificates of that file
    /// instead (a private CA, or a self-signed upstream). The error says what is wrong with the
    /// file.
    pub fn new(ca_file: Option<&Path>) -> Result<Self, String> {
        let (roots, store) = match ca_file {
            None => (
                "Mozilla's roots".to_owned(),
                RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                },
            ),
            Some(path) => (path.display().to_string(), read_roots(path)?),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS set-up failed: {e}"))?
            .with_root_certificates(store)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        // The TLS connector below hands it https:// URLs too.
        http.enforce_http(false);
        let https = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            roots,
        })
    }

    /// Sends a request.
    pub fn request(&self, req: Request<Full<Bytes>>) -> ResponseFuture {
        self.client.request(req)
    }
}

/// The certificates of a PEM file, at least one.
fn read_roots(path: &Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read {shown}: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{shown} is not a PEM certificate file: {e}"))?;
    let mut store = RootCertStore::empty();
    let (added, ignored) = store.add_parsable_certificates(certs);
    if ignored > 0 {
        return Err(format!(
            "{shown}: {ignored} certificate(s) could not be parsed"
        ));
    }
    if added == 0 {
        return Err(format!("{shown} holds no PEM certificate"));
    }
    Ok(store)
}

/// An error and its sources, joined: hyper's own message ("client error (Connect)") says
/// nothing of the cause, such as a certificate the upstream's trust anchors do not cover.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
