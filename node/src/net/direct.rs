//! A direct QUIC endpoint for tensors between peers that can reach each other.
//!
//! libp2p's QUIC transport keeps its TLS configuration private, and libp2p-tls offers
//! ChaCha20-Poly1305 first; on CPUs with AES instructions that costs about a quarter of the
//! throughput (`shoal bench net`). This endpoint speaks plain quinn with AES-GCM first, while
//! keeping libp2p's authentication: each side presents a libp2p-tls certificate (which binds the
//! TLS key to its libp2p identity) and the peer's PeerId is read from it after the handshake.
//! Its UDP port is advertised in identify's agent version; a peer that cannot be reached on it
//! is served over the libp2p stream instead.

use futures::{AsyncRead, AsyncWrite};
use libp2p::PeerId;
use libp2p::identity::Keypair;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// ALPN of the direct tensor endpoint (major version 1).
const ALPN: &[u8] = b"shoal-tensor/1";
/// How long a direct connection attempt may take before the libp2p path is used instead.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The close code of a connection to or from a banned peer.
const BANNED: quinn::VarInt = quinn::VarInt::from_u32(2);

/// Accepts any well-formed libp2p certificate (self-signed, with a valid identity extension)
/// and checks handshake signatures against it; which PeerId it names is checked by the caller.
#[derive(Debug)]
struct Libp2pCertVerifier;

fn verify_cert(cert: &CertificateDer<'_>) -> Result<(), rustls::Error> {
    libp2p::tls::certificate::parse(cert)
        .map(|_| ())
        .map_err(|e| rustls::Error::General(format!("not a libp2p certificate: {e}")))
}

fn verify_tls13(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    let parsed = libp2p::tls::certificate::parse(cert)
        .map_err(|e| rustls::Error::General(format!("not a libp2p certificate: {e}")))?;
    parsed
        .verify_signature(dss.scheme, message, dss.signature())
        .map_err(|e| rustls::Error::General(format!("bad handshake signature: {e}")))?;
    Ok(HandshakeSignatureValid::assertion())
}

const SCHEMES: [SignatureScheme; 6] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PSS_SHA384,
    SignatureScheme::RSA_PSS_SHA512,
];

impl ServerCertVerifier for Libp2pCertVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if !intermediates.is_empty() {
            return Err(rustls::Error::General(
                "unexpected certificate chain".into(),
            ));
        }
        verify_cert(end_entity)?;
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not supported".into()))
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        SCHEMES.to_vec()
    }
}

impl ClientCertVerifier for Libp2pCertVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if !intermediates.is_empty() {
            return Err(rustls::Error::General(
                "unexpected certificate chain".into(),
            ));
        }
        verify_cert(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not supported".into()))
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        SCHEMES.to_vec()
    }
}

/// Presents this node's libp2p certificate as server and as client.
#[derive(Debug)]
struct FixedCert(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for FixedCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

impl rustls::client::ResolvesClientCert for FixedCert {
    fn resolve(
        &self,
        _: &[&[u8]],
        _: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
    fn has_certs(&self) -> bool {
        true
    }
}

/// The PeerId named by the certificate the remote side of `conn` presented.
fn remote_peer(conn: &quinn::Connection) -> Option<PeerId> {
    let identity = conn.peer_identity()?;
    let certs = identity.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    let cert = certs.first()?;
    libp2p::tls::certificate::parse(cert)
        .ok()
        .map(|c| c.peer_id())
}

/// A bidirectional quinn stream as one `AsyncRead + AsyncWrite` object.
pub struct DirectStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl AsyncRead for DirectStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        AsyncRead::poll_read(Pin::new(&mut self.recv), cx, buf)
    }
}

impl AsyncWrite for DirectStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.send), cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.send), cx)
    }
    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_close(Pin::new(&mut self.send), cx)
    }
}

/// The direct endpoint: accepts authenticated connections and keeps one outgoing connection
/// per peer.
pub struct DirectEndpoint {
    endpoint: quinn::Endpoint,
    connections: Mutex<HashMap<PeerId, quinn::Connection>>,
    /// Inbound connections alive now, and the most allowed.
    inbound: Arc<AtomicUsize>,
    max_inbound: AtomicUsize,
    ip_slots: super::ip_limits::IpSlots,
    /// Peers cut off (see [`DirectEndpoint::ban`]).
    banned: Mutex<HashSet<PeerId>>,
    /// Inbound connections open now, by peer: a ban closes them at once, not at the peer's
    /// next stream.
    inbound_conns: Mutex<HashMap<PeerId, Vec<quinn::Connection>>>,
}

impl DirectEndpoint {
    /// Binds a UDP socket at `addr` (port 0: any) with this node's identity, accepting at most
    /// `max_inbound` connections at once and at most what `ip_slots` allows from one address.
    pub fn bind(
        key: &Keypair,
        addr: SocketAddr,
        max_inbound: usize,
        ip_slots: super::ip_limits::IpSlots,
    ) -> anyhow::Result<Arc<Self>> {
        let (cert, private_key) = libp2p::tls::certificate::generate(key)?;
        // rustls's default order: AES-GCM first.
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier = Arc::new(Libp2pCertVerifier);
        // rustls's `with_single_cert` re-parses the certificate with webpki, which rejects
        // libp2p's critical identity extension: hand it over through a resolver instead.
        let signing_key = provider.key_provider.load_private_key(private_key)?;
        let certified = Arc::new(rustls::sign::CertifiedKey::new(vec![cert], signing_key));
        let resolver = Arc::new(FixedCert(certified));
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier.clone())
            .with_cert_resolver(resolver.clone());
        server.alpn_protocols = vec![ALPN.to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_cert_resolver(resolver);
        client.alpn_protocols = vec![ALPN.to_vec()];
        let transport = Arc::new(super::quic_transport_config());
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(server)?,
        ));
        server_config.transport_config(transport.clone());
        let mut client_config = quinn::ClientConfig::new(Arc::new(
            quinn::crypto::rustls::QuicClientConfig::try_from(client)?,
        ));
        client_config.transport_config(transport);
        let mut endpoint = quinn::Endpoint::server(server_config, addr)?;
        endpoint.set_default_client_config(client_config);
        Ok(Arc::new(DirectEndpoint {
            endpoint,
            connections: Mutex::default(),
            inbound: Arc::default(),
            max_inbound: AtomicUsize::new(max_inbound),
            ip_slots,
            banned: Mutex::default(),
            inbound_conns: Mutex::default(),
        }))
    }

    /// The UDP port peers reach this endpoint on.
    pub fn port(&self) -> u16 {
        self.endpoint.local_addr().map_or(0, |a| a.port())
    }

    /// Opens a stream to `peer` at `addr`, connecting first if needed; fails (so the caller
    /// falls back to libp2p) if the peer is unreachable or is not who it should be.
    pub async fn open_stream(&self, peer: PeerId, addr: SocketAddr) -> io::Result<DirectStream> {
        if self.is_banned(peer) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "banned peer",
            ));
        }
        let existing = self.lock().get(&peer).cloned();
        let conn = match existing {
            // A peer that restarted advertises a new address: the old connection is dead
            // even if its idle timeout has not noticed yet.
            Some(c) if c.close_reason().is_none() && c.remote_address() == addr => c,
            _ => {
                let connecting = self
                    .endpoint
                    .connect(addr, "shoal")
                    .map_err(|e| io::Error::new(io::ErrorKind::ConnectionRefused, e))?;
                let conn = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
                    .await
                    .map_err(|_| {
                        io::Error::new(io::ErrorKind::TimedOut, "direct connect timed out")
                    })?
                    .map_err(|e| io::Error::new(io::ErrorKind::ConnectionRefused, e))?;
                if remote_peer(&conn) != Some(peer) {
                    conn.close(1u32.into(), b"wrong peer");
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "direct endpoint is another peer",
                    ));
                }
                self.lock().insert(peer, conn.clone());
                conn
            }
        };
        let (send, recv) = conn
            .open_bi()
            .await
            .map_err(|e| io::Error::new(io::ErrorKind::ConnectionReset, e))?;
        Ok(DirectStream { send, recv })
    }

    /// Accepts up to `max` inbound connections at once from now on.
    pub fn set_max_inbound(&self, max: usize) {
        self.max_inbound.store(max, Ordering::Relaxed);
    }

    /// Cuts `peer` off: the connection to it and its connections here close, and new ones
    /// from it are closed as soon as the handshake names it.
    pub fn ban(&self, peer: PeerId) {
        self.banned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer);
        if let Some(conn) = self.lock().remove(&peer) {
            conn.close(BANNED, b"banned");
        }
        let inbound = self.inbound_lock().remove(&peer).unwrap_or_default();
        for conn in inbound {
            conn.close(BANNED, b"banned");
        }
    }

    /// Inbound connections from `peer` open now.
    pub fn inbound_from(&self, peer: PeerId) -> usize {
        self.inbound_lock().get(&peer).map_or(0, Vec::len)
    }

    fn inbound_lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, Vec<quinn::Connection>>> {
        self.inbound_conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_banned(&self, peer: PeerId) -> bool {
        self.banned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&peer)
    }

    /// Forgets the connection to `peer` (a transfer on it failed), so the next transfer
    /// reconnects. It is not closed: other transfers may still be using it, and it closes by
    /// itself once they are done.
    pub fn forget(&self, peer: PeerId) {
        self.lock().remove(&peer);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, quinn::Connection>> {
        self.connections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accepts connections and hands each authenticated stream to `admit`.
    pub async fn accept(
        self: Arc<Self>,
        admit: impl Fn(PeerId, DirectStream) + Clone + Send + Sync + 'static,
    ) {
        while let Some(incoming) = self.endpoint.accept().await {
            if self.inbound.fetch_add(1, Ordering::SeqCst)
                >= self.max_inbound.load(Ordering::Relaxed)
            {
                self.inbound.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(remote = %incoming.remote_address(), "direct connection refused: too many");
                incoming.refuse();
                continue;
            }
            let ip = incoming.remote_address().ip();
            if let Err(e) = self.ip_slots.take(ip) {
                self.inbound.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("direct connection refused: {e}");
                incoming.refuse();
                continue;
            }
            let (admit, inbound, slots, this) = (
                admit.clone(),
                self.inbound.clone(),
                self.ip_slots.clone(),
                self.clone(),
            );
            tokio::spawn(async move {
                if let Ok(Ok(conn)) = tokio::time::timeout(CONNECT_TIMEOUT, incoming).await {
                    match remote_peer(&conn) {
                        Some(peer) => {
                            this.inbound_lock()
                                .entry(peer)
                                .or_default()
                                .push(conn.clone());
                            // Checked after registering: a ban in between closes it either way.
                            if this.is_banned(peer) {
                                conn.close(BANNED, b"banned");
                            }
                            while let Ok((send, recv)) = conn.accept_bi().await {
                                if this.is_banned(peer) {
                                    conn.close(BANNED, b"banned");
                                    break;
                                }
                                admit(peer, DirectStream { send, recv });
                            }
                            let id = conn.stable_id();
                            let mut open = this.inbound_lock();
                            if let Some(list) = open.get_mut(&peer) {
                                list.retain(|c| c.stable_id() != id);
                                if list.is_empty() {
                                    open.remove(&peer);
                                }
                            }
                        }
                        None => conn.close(1u32.into(), b"no libp2p identity"),
                    }
                }
                inbound.fetch_sub(1, Ordering::SeqCst);
                slots.release(ip);
            });
        }
    }
}
