//! `--metrics ADDR`: Prometheus metrics over HTTP (`GET /metrics`, OpenMetrics text). The
//! names follow Prometheus conventions: `shoal_` first, base units (bytes, seconds) in the
//! name, counters ending in `_total`.
//!
//! The endpoint is for the operator (bind it to localhost or a private network): it answers
//! any client, but reads at most a request head of 8 KiB within 5 s per connection and serves
//! at most 16 connections at once, so a flood of clients costs it little.

use anyhow::Context;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The largest request head read.
const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Connections served at once.
const MAX_CONNECTIONS: usize = 16;

/// Serves `registry` at `http://addr/metrics` until the process ends; the address bound
/// (`addr` may name port 0).
pub async fn serve(addr: SocketAddr, registry: Arc<Registry>) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--metrics {addr}: cannot listen"))?;
    let bound = listener.local_addr()?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue; // Dropped: the client sees the connection close.
            };
            let registry = registry.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let answer =
                    tokio::time::timeout(Duration::from_secs(5), answer(stream, &registry));
                if let Ok(Err(e)) = answer.await {
                    tracing::debug!("metrics request: {e}");
                }
            });
        }
    });
    Ok(bound)
}

/// Reads one request and answers it; the connection closes after.
async fn answer(mut stream: tokio::net::TcpStream, registry: &Registry) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || head.len() + n > MAX_REQUEST_HEAD {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|b| *b == b' ');
    let (method, path) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    let path = path.split(|b| *b == b'?').next().unwrap_or_default();
    let (status, content_type, body) = match (method, path) {
        (b"GET", b"/metrics") => {
            let mut text = String::new();
            encode(&mut text, registry).map_err(std::io::Error::other)?;
            (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            )
        }
        (b"GET", _) => ("404 Not Found", "text/plain", "see /metrics\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_string(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
