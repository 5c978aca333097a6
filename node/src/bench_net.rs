//! `shoal bench net`: tensor frames between two nodes on this machine, against plain quinn
//! moving the same payload in the same way, in the same run.

use crate::cli::BenchNetArgs;
use anyhow::Context;
use futures::StreamExt;
use libp2p::identity::Keypair;
use serde::Serialize;
use shoal_node::net::{self, NetConfig, NodeEvent};
use shoal_protocol::wire::{FrameHeader, FrameKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Serialize)]
struct NetBench {
    frame_mib: usize,
    frames: usize,
    in_flight: usize,
    total_mib: usize,
    /// Plain quinn (its default cipher order: AES-GCM first), one stream per frame, same
    /// windows, same acknowledgement.
    raw_quinn_mib_s: f64,
    /// Plain quinn with the cipher libp2p's TLS config prefers (ChaCha20-Poly1305).
    raw_quinn_chacha_mib_s: f64,
    /// shoal's tensor transport as it runs: the direct endpoint between reachable peers.
    shoal_mib_s: f64,
    /// shoal's fallback path: libp2p-stream on libp2p's QUIC connection (ChaCha20).
    shoal_libp2p_mib_s: f64,
    /// shoal / plain quinn.
    ratio: f64,
    /// shoal's libp2p path / plain quinn on the same cipher: the cost of libp2p itself.
    ratio_libp2p_same_cipher: f64,
    /// Median time to send a 64-byte frame and get its acknowledgement (new stream each).
    rtt_us_median: f64,
    raw_quinn_rtt_us_median: f64,
}

pub fn net(args: BenchNetArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(measure(&args))?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "{} x {} MiB frames, {} in flight: shoal {:.0} MiB/s, plain quinn {:.0} MiB/s (ratio {:.2}); \
             shoal over libp2p {:.0} MiB/s vs plain quinn on its cipher {:.0} MiB/s (ratio {:.2}); \
             small-frame round trip {:.0} us (quinn {:.0} us)",
            result.frames,
            result.frame_mib,
            result.in_flight,
            result.shoal_mib_s,
            result.raw_quinn_mib_s,
            result.ratio,
            result.shoal_libp2p_mib_s,
            result.raw_quinn_chacha_mib_s,
            result.ratio_libp2p_same_cipher,
            result.rtt_us_median,
            result.raw_quinn_rtt_us_median
        );
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

const SMALL_FRAMES: usize = 200;

async fn measure(args: &BenchNetArgs) -> anyhow::Result<NetBench> {
    let frame_bytes = args.frame_mib << 20;
    let payload: Arc<Vec<u8>> = Arc::new((0..frame_bytes).map(|i| (i * 7 + 3) as u8).collect());
    let total = frame_bytes * args.frames;
    // Alternate so that background load hits both alike; keep each one's best run.
    let (mut quinn_best, mut chacha_best, mut shoal_best, mut libp2p_best) =
        (0f64, 0f64, 0f64, 0f64);
    let (mut quinn_rtt, mut shoal_rtt) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        let (secs, rtt) = raw_quinn(&payload, args.frames, args.in_flight, Cipher::Default)
            .await
            .context("plain quinn")?;
        quinn_best = quinn_best.max(total as f64 / secs / (1 << 20) as f64);
        quinn_rtt.extend(rtt);
        let (secs, _) = raw_quinn(&payload, args.frames, args.in_flight, Cipher::ChaCha20)
            .await
            .context("plain quinn on ChaCha20")?;
        chacha_best = chacha_best.max(total as f64 / secs / (1 << 20) as f64);
        let (secs, rtt) = shoal_streams(&payload, args.frames, args.in_flight, true)
            .await
            .context("shoal, direct")?;
        shoal_best = shoal_best.max(total as f64 / secs / (1 << 20) as f64);
        shoal_rtt.extend(rtt);
        let (secs, _) = shoal_streams(&payload, args.frames, args.in_flight, false)
            .await
            .context("shoal over libp2p")?;
        libp2p_best = libp2p_best.max(total as f64 / secs / (1 << 20) as f64);
    }
    Ok(NetBench {
        frame_mib: args.frame_mib,
        frames: args.frames,
        in_flight: args.in_flight,
        total_mib: total >> 20,
        raw_quinn_mib_s: quinn_best,
        raw_quinn_chacha_mib_s: chacha_best,
        shoal_mib_s: shoal_best,
        shoal_libp2p_mib_s: libp2p_best,
        ratio: shoal_best / quinn_best,
        ratio_libp2p_same_cipher: libp2p_best / chacha_best,
        rtt_us_median: median(shoal_rtt),
        raw_quinn_rtt_us_median: median(quinn_rtt),
    })
}

/// Moves `frames` frames of `payload` from one node to another; returns the seconds it took
/// and the round trips of small frames.
async fn shoal_streams(
    payload: &Arc<Vec<u8>>,
    frames: usize,
    in_flight: usize,
    direct: bool,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let local = |bootstrap: Vec<libp2p::Multiaddr>| NetConfig {
        listen: vec![
            "/ip4/127.0.0.1/udp/0/quic-v1"
                .parse()
                .expect("valid address"),
        ],
        bootstrap,
        mdns: false,
        run: "bench".into(),
        direct,
        ..NetConfig::default()
    };
    let (receiver, mut receiver_events, mut inbound) =
        net::start(Keypair::generate_ed25519(), local(Vec::new())).await?;
    let addr = loop {
        match receiver_events.recv().await {
            Some(NodeEvent::Listening(addr)) => break addr,
            Some(_) => continue,
            None => anyhow::bail!("receiver stopped"),
        }
    };
    // The application side of the receiver: take frames as they come.
    tokio::spawn(async move { while inbound.recv().await.is_some() {} });
    let (sender, mut sender_events, _) =
        net::start(Keypair::generate_ed25519(), local(vec![addr])).await?;
    let target = receiver.peer_id;
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(e) = sender_events.recv().await {
            // Identified: the receiver's direct endpoint (if any) is known by then.
            if matches!(e, NodeEvent::Discovered(p) if p == target) {
                break;
            }
        }
    })
    .await
    .context("the two nodes did not connect")?;

    let send = |data: Arc<Vec<u8>>| {
        let sender = sender.clone();
        async move { Ok(sender.send_frame(target, FrameKind::Tensor, &data).await?) }
    };
    time_transfers(send, payload, frames, in_flight).await
}

/// Times `SMALL_FRAMES` small frames one after another (round trips), then `frames` frames of
/// `payload` with `in_flight` at once (throughput); returns the seconds of the latter and the
/// round trips in microseconds.
async fn time_transfers<F, Fut>(
    send: F,
    payload: &Arc<Vec<u8>>,
    frames: usize,
    in_flight: usize,
) -> anyhow::Result<(f64, Vec<f64>)>
where
    F: Fn(Arc<Vec<u8>>) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let small = Arc::new(vec![0u8; 64]);
    let mut rtt = Vec::with_capacity(SMALL_FRAMES);
    for _ in 0..SMALL_FRAMES {
        let start = Instant::now();
        send(small.clone()).await?;
        rtt.push(start.elapsed().as_secs_f64() * 1e6);
    }
    let start = Instant::now();
    let results: Vec<_> = futures::stream::iter(0..frames)
        .map(|_| send(payload.clone()))
        .buffer_unordered(in_flight)
        .collect()
        .await;
    let secs = start.elapsed().as_secs_f64();
    for r in results {
        r?;
    }
    Ok((secs, rtt))
}

#[derive(Clone, Copy, PartialEq)]
enum Cipher {
    /// rustls's order: AES-GCM first (fastest where the CPU has AES instructions).
    Default,
    /// What libp2p's TLS configuration prefers.
    ChaCha20,
}

/// The same transfer over plain quinn: one bidirectional stream per frame, the same frame
/// header, the same one-byte acknowledgement, the same receive windows.
async fn raw_quinn(
    payload: &Arc<Vec<u8>>,
    frames: usize,
    in_flight: usize,
    cipher: Cipher,
) -> anyhow::Result<(f64, Vec<f64>)> {
    use rustls::crypto::aws_lc_rs::{cipher_suite, default_provider};
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])?;
    let cert_der = rustls::pki_types::CertificateDer::from(cert.cert);
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());
    let mut provider = default_provider();
    if cipher == Cipher::ChaCha20 {
        // QUIC's initial packets always use AES-128-GCM, so it must stay in the list.
        provider.cipher_suites = vec![
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
            cipher_suite::TLS13_AES_128_GCM_SHA256,
        ];
    }
    let provider = Arc::new(provider);
    let tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert_der.clone()], key.into())?;
    let transport = Arc::new(net::quic_transport_config());
    let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(tls)?,
    ));
    server_config.transport_config(transport.clone());
    let server = quinn::Endpoint::server(server_config, "127.0.0.1:0".parse()?)?;
    let server_addr = server.local_addr()?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert_der)?;
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut client_config = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls)?,
    ));
    client_config.transport_config(transport);
    let mut client = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    client.set_default_client_config(client_config);

    let max = payload.len() + 64;
    tokio::spawn(async move {
        while let Some(incoming) = server.accept().await {
            let Ok(conn) = incoming.await else { continue };
            tokio::spawn(async move {
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        if recv.read_to_end(max).await.is_ok() {
                            let _ = send.write_all(&[0x06]).await;
                            let _ = send.finish();
                        }
                    });
                }
            });
        }
    });
    let conn = client.connect(server_addr, "localhost")?.await?;
    let send_one = |conn: quinn::Connection, payload: Arc<Vec<u8>>| async move {
        let (mut send, mut recv) = conn.open_bi().await?;
        let header = FrameHeader {
            kind: FrameKind::Tensor,
            len: payload.len() as u32,
        }
        .to_bytes();
        send.write_all(&header).await?;
        send.write_all(&payload).await?;
        send.finish()?;
        let mut ack = [0u8; 1];
        recv.read_exact(&mut ack).await?;
        anyhow::Ok(())
    };
    let result = time_transfers(
        |data| send_one(conn.clone(), data),
        payload,
        frames,
        in_flight,
    )
    .await;
    conn.close(0u32.into(), b"done");
    result
}
