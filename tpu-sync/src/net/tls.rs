//! Peer authentication for the TLS and QUIC transports (rustls, TLS 1.3 only, `ring` provider).
//!
//! Two modes, both mutual (each side proves itself to the other; a side without valid
//! credentials is refused during the handshake, before it can send or read a single frame):
//!
//! * **CA** ([`Security::from_pem_files`]): each side presents a certificate chain and its
//!   private key; each side accepts only a peer whose end-entity certificate chains to the
//!   configured CA (rustls' WebPKI verifiers). The server certificate must also name the
//!   configured server name as a DNS subject alternative name (default [`DEFAULT_SERVER_NAME`]),
//!   because peers are dialled by IP address in a cluster: the name is a cluster-wide role, not a
//!   host name. Certificates must allow both `serverAuth` and `clientAuth` extended key usages
//!   when they carry the extension (an endpoint is server and client at once).
//! * **Pre-shared key** ([`Security::from_psk`]): rustls has no external-PSK mode, so the key is
//!   turned into an identity: HKDF-SHA256 over the PSK derives an Ed25519 key pair; both sides
//!   present a self-signed certificate for that key and accept only a peer whose certificate
//!   carries exactly the same public key (public-key pinning; the handshake signature proves
//!   possession of the private key). Properties: only holders of the PSK can complete a
//!   handshake in either direction; the session keys still come from an ephemeral (EC)DHE
//!   exchange, so recorded traffic stays secret if the PSK leaks later (forward secrecy); all
//!   holders share one identity, so the PSK authenticates group membership, not an individual
//!   peer. An active attacker that connects learns the derived public key and can test PSK
//!   guesses offline against it, so the PSK must be high-entropy: at least
//!   [`MIN_PSK_BYTES`] bytes are required, 32 random bytes recommended (`head -c 32 /dev/urandom`).
//!
//! [`generate_test_pki`] writes an ephemeral CA and per-endpoint certificates (rcgen) for tests and
//! the demo.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::error::{Error, Result};

/// ALPN protocol id of this wire protocol (both TLS and QUIC).
pub const ALPN: &[u8] = b"tpu-sync/2";
/// Server name the client expects in the server's certificate by default.
pub const DEFAULT_SERVER_NAME: &str = "tpu-sync";
/// Shortest pre-shared key accepted (bytes).
pub const MIN_PSK_BYTES: usize = 16;

/// How peers authenticate each other. Cheap to clone.
#[derive(Clone)]
pub enum Security {
    /// No authentication (plain TCP only).
    None,
    /// Certificates signed by a common CA.
    Ca {
        /// Trusted CA certificates.
        roots: Arc<rustls::RootCertStore>,
        /// This endpoint's certificate chain (end entity first).
        chain: Vec<CertificateDer<'static>>,
        /// This endpoint's private key.
        key: Arc<PrivateKeyDer<'static>>,
        /// DNS name expected in the server's certificate.
        server_name: String,
    },
    /// A key pair derived from a pre-shared key, pinned on both sides.
    Psk {
        /// The derived self-signed certificate.
        cert: CertificateDer<'static>,
        /// The derived private key (PKCS#8 Ed25519).
        key: Arc<PrivateKeyDer<'static>>,
        /// The derived SubjectPublicKeyInfo (DER) a peer must present.
        spki: Vec<u8>,
    },
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Security::None => f.write_str("Security::None"),
            Security::Ca { server_name, .. } => write!(f, "Security::Ca({server_name})"),
            Security::Psk { .. } => f.write_str("Security::Psk"),
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{what}: {e}"))
}

impl Security {
    /// Loads PEM files: this endpoint's certificate chain, its private key (PKCS#8, PKCS#1 or
    /// SEC1) and the CA certificate(s) peers must chain to. `server_name`: the DNS name every
    /// server certificate must carry (`None`: [`DEFAULT_SERVER_NAME`]).
    ///
    /// Errors: [`Error::Io`] for unreadable files, [`Error::InvalidArgument`] for files without
    /// the expected PEM sections or an invalid server name.
    pub fn from_pem_files(
        cert: &Path,
        key: &Path,
        ca: &Path,
        server_name: Option<&str>,
    ) -> Result<Security> {
        let read =
            |p: &Path| std::fs::read(p).map_err(|e| Error::io(format!("read {}", p.display()), e));
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(cert)?)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| tls_err(&format!("certificate {}", cert.display()), e))?;
        if chain.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{} holds no PEM certificate",
                cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_slice(&read(key)?)
            .map_err(|e| tls_err(&format!("private key {}", key.display()), e))?;
        let mut roots = rustls::RootCertStore::empty();
        let mut n = 0;
        for c in CertificateDer::pem_slice_iter(&read(ca)?) {
            let c = c.map_err(|e| tls_err(&format!("CA {}", ca.display()), e))?;
            roots
                .add(c)
                .map_err(|e| tls_err(&format!("CA {}", ca.display()), e))?;
            n += 1;
        }
        if n == 0 {
            return Err(Error::InvalidArgument(format!(
                "{} holds no PEM CA certificate",
                ca.display()
            )));
        }
        let server_name = server_name.unwrap_or(DEFAULT_SERVER_NAME).to_string();
        ServerName::try_from(server_name.clone())
            .map_err(|e| tls_err(&format!("server name `{server_name}`"), e))?;
        Ok(Security::Ca {
            roots: Arc::new(roots),
            chain,
            key: Arc::new(key),
            server_name,
        })
    }

    /// Derives the pinned identity of a pre-shared key (see the module docs).
    ///
    /// Errors: [`Error::InvalidArgument`] for a key shorter than [`MIN_PSK_BYTES`].
    pub fn from_psk(psk: &[u8]) -> Result<Security> {
        if psk.len() < MIN_PSK_BYTES {
            return Err(Error::InvalidArgument(format!(
                "pre-shared key of {} bytes is too short (at least {MIN_PSK_BYTES}; use 32 random bytes)",
                psk.len()
            )));
        }
        let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"tpu-sync psk identity v1");
        let prk = salt.extract(psk);
        let mut seed = [0u8; 32];
        prk.expand(&[b"ed25519 seed"], ring::hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut seed))
            .map_err(|_| Error::InvalidArgument("HKDF expansion failed".into()))?;
        // PKCS#8 v1 wrapping of an Ed25519 seed (RFC 8410 section 7): a fixed 16-byte prefix.
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&seed);
        let pkcs8 = PrivatePkcs8KeyDer::from(der);
        let kp = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
            .map_err(|e| tls_err("PSK key pair", e))?;
        let mut params = rcgen::CertificateParams::new(vec![DEFAULT_SERVER_NAME.to_string()])
            .map_err(|e| tls_err("PSK certificate", e))?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tpu-sync psk peer");
        let cert = params
            .self_signed(&kp)
            .map_err(|e| tls_err("PSK certificate", e))?;
        let cert = cert.der().clone();
        let spki = rustls::server::ParsedCertificate::try_from(&cert)
            .map_err(|e| tls_err("PSK certificate", e))?
            .subject_public_key_info()
            .as_ref()
            .to_vec();
        Ok(Security::Psk {
            cert,
            key: Arc::new(PrivateKeyDer::Pkcs8(pkcs8)),
            spki,
        })
    }

    /// Reads a pre-shared key file (its raw bytes; surrounding whitespace is ignored) and calls
    /// [`Security::from_psk`].
    pub fn from_psk_file(path: &Path) -> Result<Security> {
        let b =
            std::fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        let s = b.trim_ascii();
        Security::from_psk(s)
    }

    /// Whether peers are authenticated.
    pub fn is_authenticated(&self) -> bool {
        !matches!(self, Security::None)
    }

    /// Short description for logs and reports (`no authentication, no encryption`, `mutual TLS
    /// (CA)`, `pre-shared key`).
    pub fn describe(&self) -> &'static str {
        match self {
            Security::None => "no authentication, no encryption",
            Security::Ca { .. } => "mutual TLS (CA)",
            Security::Psk { .. } => "pre-shared key",
        }
    }

    /// The name a client puts in its SNI and checks in the server certificate.
    pub(crate) fn server_name(&self) -> ServerName<'static> {
        let n = match self {
            Security::Ca { server_name, .. } => server_name.clone(),
            _ => DEFAULT_SERVER_NAME.to_string(),
        };
        ServerName::try_from(n).unwrap_or_else(|_| {
            ServerName::try_from(DEFAULT_SERVER_NAME.to_string()).expect("valid default name")
        })
    }

    /// The rustls server configuration (TLS 1.3 only, client certificates mandatory).
    pub(crate) fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        let p = provider();
        let builder = rustls::ServerConfig::builder_with_provider(p.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("TLS server config", e))?;
        let mut cfg =
            match self {
                Security::None => return Err(Error::InvalidArgument(
                    "TLS and QUIC need credentials: certificates (--tls-cert/--tls-key/--tls-ca) \
                     or a pre-shared key (--psk-file)"
                        .into(),
                )),
                Security::Ca {
                    roots, chain, key, ..
                } => {
                    let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                        roots.clone(),
                        p.clone(),
                    )
                    .build()
                    .map_err(|e| tls_err("client verifier", e))?;
                    builder
                        .with_client_cert_verifier(v)
                        .with_single_cert(chain.clone(), key.clone_key())
                        .map_err(|e| tls_err("certificate/key", e))?
                }
                Security::Psk { cert, key, spki } => builder
                    .with_client_cert_verifier(Arc::new(PinnedKey::new(spki.clone(), &p)))
                    .with_single_cert(vec![cert.clone()], key.clone_key())
                    .map_err(|e| tls_err("PSK certificate/key", e))?,
            };
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Arc::new(cfg))
    }

    /// The rustls client configuration (TLS 1.3 only, presents this endpoint's certificate).
    pub(crate) fn client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        let p = provider();
        let builder = rustls::ClientConfig::builder_with_provider(p.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("TLS client config", e))?;
        let mut cfg = match self {
            Security::None => {
                return Err(Error::InvalidArgument(
                    "TLS and QUIC need credentials: certificates or a pre-shared key".into(),
                ))
            }
            Security::Ca {
                roots, chain, key, ..
            } => {
                let v = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    roots.clone(),
                    p.clone(),
                )
                .build()
                .map_err(|e| tls_err("server verifier", e))?;
                builder
                    .with_webpki_verifier(v)
                    .with_client_auth_cert(chain.clone(), key.clone_key())
                    .map_err(|e| tls_err("certificate/key", e))?
            }
            Security::Psk { cert, key, spki } => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(PinnedKey::new(spki.clone(), &p)))
                .with_client_auth_cert(vec![cert.clone()], key.clone_key())
                .map_err(|e| tls_err("PSK certificate/key", e))?,
        };
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// Short identity of a peer certificate: `cert:` + the first 8 bytes of its SHA-256, hex.
pub(crate) fn cert_identity(certs: Option<&[CertificateDer<'_>]>, psk: bool) -> Option<String> {
    if psk {
        return Some("psk".into());
    }
    let c = certs?.first()?;
    let d = ring::digest::digest(&ring::digest::SHA256, c.as_ref());
    Some(format!(
        "cert:{}",
        d.as_ref()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    ))
}

/// Accepts exactly one public key (the PSK-derived one) and checks handshake signatures with it.
#[derive(Debug)]
struct PinnedKey {
    spki: Vec<u8>,
    algs: WebPkiSupportedAlgorithms,
}

impl PinnedKey {
    fn new(spki: Vec<u8>, p: &CryptoProvider) -> PinnedKey {
        PinnedKey {
            spki,
            algs: p.signature_verification_algorithms,
        }
    }

    fn check(&self, end_entity: &CertificateDer<'_>) -> std::result::Result<(), rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        if parsed.subject_public_key_info().as_ref() == self.spki.as_slice() {
            Ok(())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }
}

impl ServerCertVerifier for PinnedKey {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not allowed".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.check(cert)?;
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

impl ClientCertVerifier for PinnedKey {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not allowed".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.check(cert)?;
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// Files written by [`generate_test_pki`].
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate (PEM).
    pub ca: PathBuf,
    /// Per endpoint name: (certificate PEM, private key PEM).
    pub endpoints: Vec<(String, PathBuf, PathBuf)>,
}

impl TestPki {
    /// Certificate and key paths of endpoint `name`.
    pub fn files(&self, name: &str) -> Option<(&Path, &Path)> {
        self.endpoints
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, c, k)| (c.as_path(), k.as_path()))
    }

    /// The [`Security`] of endpoint `name`.
    pub fn security(&self, name: &str) -> Result<Security> {
        let (c, k) = self
            .files(name)
            .ok_or_else(|| Error::InvalidArgument(format!("no certificate for `{name}`")))?;
        Security::from_pem_files(c, k, &self.ca, None)
    }
}

/// Writes an ephemeral CA (`ca.pem`) and, for each name, a certificate signed by it
/// (`NAME.pem`, `NAME.key`, mode 0600) into `dir`, for tests and the demo. Certificates carry
/// the DNS names [`DEFAULT_SERVER_NAME`] and `localhost` and both TLS extended key usages.
///
/// Errors: [`Error::Io`] when a file cannot be written, [`Error::InvalidArgument`] when rcgen
/// fails.
pub fn generate_test_pki(dir: &Path, names: &[&str]) -> Result<TestPki> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let e = |x: rcgen::Error| tls_err("certificate generation", x);
    std::fs::create_dir_all(dir).map_err(|x| Error::io(format!("mkdir {}", dir.display()), x))?;
    let ca_key = KeyPair::generate().map_err(e)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.distinguished_name
        .push(DnType::CommonName, "tpu-sync ephemeral CA");
    let ca_cert = ca.self_signed(&ca_key).map_err(e)?;
    let write = |p: &Path, s: &str, secret: bool| -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // Secrets are created 0600 (never readable by others, not even briefly), and an existing
        // file or a planted symlink at the path is replaced by neither: O_NOFOLLOW, truncate of
        // our own file only.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(if secret { 0o600 } else { 0o644 })
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(p)
            .map_err(|x| Error::io(format!("write {}", p.display()), x))?;
        if secret {
            use std::os::unix::fs::PermissionsExt;
            f.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(|x| Error::io(format!("chmod {}", p.display()), x))?;
        }
        f.write_all(s.as_bytes())
            .map_err(|x| Error::io(format!("write {}", p.display()), x))
    };
    let ca_path = dir.join("ca.pem");
    write(&ca_path, &ca_cert.pem(), false)?;
    let mut endpoints = Vec::new();
    for name in names {
        let key = KeyPair::generate().map_err(e)?;
        let mut p = CertificateParams::new(vec![
            DEFAULT_SERVER_NAME.to_string(),
            "localhost".to_string(),
        ])
        .map_err(e)?;
        p.distinguished_name.push(DnType::CommonName, *name);
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p.signed_by(&key, &ca_cert, &ca_key).map_err(e)?;
        let cp = dir.join(format!("{name}.pem"));
        let kp = dir.join(format!("{name}.key"));
        write(&cp, &cert.pem(), false)?;
        write(&kp, &key.serialize_pem(), true)?;
        endpoints.push((name.to_string(), cp, kp));
    }
    Ok(TestPki {
        ca: ca_path,
        endpoints,
    })
}
