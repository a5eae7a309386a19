//! The client of one upstream: its own connection pool and, for `https://`, its own trust
//! anchors (Mozilla's roots compiled in, or the CA certificates of the upstream's `ca_file`),
//! reached directly or through an HTTP proxy's `CONNECT` tunnel.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use http::{HeaderValue, Uri};
use http_body_util::Full;
use hyper::Request;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::proxy::Tunnel;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

type Body = Full<Bytes>;

/// An upstream's HTTP client (cheap to clone: clones share the pool).
#[derive(Clone)]
pub struct UpstreamClient {
    inner: Inner,
    /// Where its trust anchors came from and the proxy it goes through, for `Debug` (without
    /// the proxy's credentials).
    shown: String,
}

#[derive(Clone)]
enum Inner {
    Direct(Client<HttpsConnector<HttpConnector>, Body>),
    Tunnelled(Client<HttpsConnector<Tunnel<HttpConnector>>, Body>),
}

impl fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("connects", &self.shown)
            .finish_non_exhaustive()
    }
}

/// Where an upstream's connections go first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Route<'a> {
    /// A PEM file of the CA certificates to trust instead of Mozilla's roots.
    pub ca_file: Option<&'a Path>,
    /// `http://[user:password@]host:port` of a proxy to open a `CONNECT` tunnel through.
    pub proxy: Option<&'a str>,
}

impl UpstreamClient {
    /// A client that speaks plain HTTP and HTTPS. HTTPS servers are trusted if their chain ends
    /// in one of Mozilla's roots or, with a CA file, in one of the PEM certificates of that file
    /// instead (a private CA, or a self-signed upstream). With a proxy, every connection is a
    /// `CONNECT` tunnel through it (TLS runs end to end inside), authenticated with the proxy
    /// URL's user and password if it has them. The error names the field at fault (`ca_file`
    /// or `proxy`) and says what is wrong with it.
    pub fn new(route: Route<'_>) -> Result<Self, (&'static str, String)> {
        let proxy = route
            .proxy
            .map(parse_proxy)
            .transpose()
            .map_err(|e| ("proxy", e))?;
        let (roots, store) = match route.ca_file {
            None => (
                "Mozilla's roots".to_owned(),
                RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                },
            ),
            Some(path) => (
                path.display().to_string(),
                read_roots(path).map_err(|e| ("ca_file", e))?,
            ),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ("ca_file", format!("TLS set-up failed: {e}")))?
            .with_root_certificates(store)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        // The TLS connector around it hands it https:// URLs too.
        http.enforce_http(false);
        let builder = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1();
        let client = Client::builder(TokioExecutor::new());
        Ok(match proxy {
            None => Self {
                inner: Inner::Direct(client.build(builder.wrap_connector(http))),
                shown: roots,
            },
            Some((uri, auth)) => {
                let shown = format!("{roots}, through {}", uri);
                let mut tunnel = Tunnel::new(uri, http);
                if let Some(a) = auth {
                    tunnel = tunnel.with_auth(a);
                }
                Self {
                    inner: Inner::Tunnelled(client.build(builder.wrap_connector(tunnel))),
                    shown,
                }
            }
        })
    }

    /// Sends a request.
    pub fn request(&self, req: Request<Body>) -> ResponseFuture {
        match &self.inner {
            Inner::Direct(c) => c.request(req),
            Inner::Tunnelled(c) => c.request(req),
        }
    }
}

/// A proxy URL as the address to connect to (without credentials) and its `Proxy-Authorization`.
fn parse_proxy(proxy: &str) -> Result<(Uri, Option<HeaderValue>), String> {
    let uri: Uri = proxy
        .parse()
        .map_err(|e| format!("not a URL ({e}): expected http://[user:password@]host:port"))?;
    if uri.scheme_str() != Some("http") {
        return Err("expected http://[user:password@]host:port (an HTTP proxy)".to_owned());
    }
    let authority = uri
        .authority()
        .ok_or("expected http://[user:password@]host:port")?;
    let (credentials, host) = match authority.as_str().rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority.as_str()),
    };
    let address: Uri = format!("http://{host}")
        .parse()
        .map_err(|e| format!("bad proxy address: {e}"))?;
    let auth = match credentials {
        None => None,
        Some(c) => {
            let (user, password) = c.split_once(':').unwrap_or((c, ""));
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8()
                    .map(|d| d.into_owned())
                    .map_err(|_| "the proxy's credentials are not UTF-8".to_owned())
            };
            let token = base64::engine::general_purpose::STANDARD.encode(format!(
                "{}:{}",
                decode(user)?,
                decode(password)?
            ));
            Some(
                HeaderValue::from_str(&format!("Basic {token}"))
                    .map_err(|e| format!("bad proxy credentials: {e}"))?,
            )
        }
    };
    Ok((address, auth))
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn proxy_urls_give_an_address_and_basic_credentials() {
        let (uri, auth) = parse_proxy("http://us%40er:p%3Ass@proxy.internal:3128").unwrap();
        assert_eq!(uri, "http://proxy.internal:3128/");
        // base64("us@er:p:ss")
        assert_eq!(auth.unwrap(), "Basic dXNAZXI6cDpzcw==");
        let (uri, auth) = parse_proxy("http://10.0.0.1:8080").unwrap();
        assert_eq!(
            (uri.to_string(), auth),
            ("http://10.0.0.1:8080/".to_owned(), None)
        );
        for bad in [
            "https://proxy:3128",
            "proxy:3128",
            "http://u:%ff@proxy:1",
            "not a url",
        ] {
            assert!(parse_proxy(bad).is_err(), "{bad}");
        }
    }
}
