//! The operator's HTTP endpoints of a peer: Prometheus metrics (`--metrics ADDR`: `GET
//! /metrics`, OpenMetrics text) and the live dashboard (`--dashboard ADDR`: `GET /` the page,
//! `GET /events` its server-sent events, `GET /state` one snapshot as JSON).
//!
//! For the operator: bind them to localhost or a private network. They answer any client, but
//! read at most a request head of 8 KiB within 5 s per connection and serve at most 16
//! connections at once (an event stream holds one while its page is open), so a flood of
//! clients costs a peer little.

use anyhow::Context;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

/// The largest request head read.
const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Connections served at once.
const MAX_CONNECTIONS: usize = 16;
/// The dashboard page, its script and style included: nothing is fetched from elsewhere.
const DASHBOARD_PAGE: &str = include_str!("dashboard.html");

/// What an endpoint serves.
#[derive(Default)]
pub struct Routes {
    /// `/metrics`.
    pub metrics: Option<Arc<Registry>>,
    /// `/`, `/events` and `/state`: the latest dashboard snapshot (JSON).
    pub dashboard: Option<watch::Receiver<Arc<String>>>,
}

/// Serves `routes` at `addr` until the process ends; the address bound (`addr` may name
/// port 0).
pub async fn serve(addr: SocketAddr, routes: Routes) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let routes = Arc::new(routes);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                // Out of file descriptors, say: wait rather than spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue; // Dropped: the client sees the connection close.
            };
            let routes = routes.clone();
            tokio::spawn(async move {
                let _slot = slot;
                if let Err(e) = answer(stream, &routes).await {
                    tracing::debug!("http request: {e}");
                }
            });
        }
    });
    Ok(bound)
}

/// The method and path of a request head, once it has arrived whole.
async fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<(String, String)>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || head.len() + n > MAX_REQUEST_HEAD {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(head.split(|b| *b == b'\r').next().unwrap_or_default())
        .into_owned();
    let mut words = line.split(' ');
    let method = words.next().unwrap_or_default().to_owned();
    let path = words.next().unwrap_or_default();
    let path = path.split('?').next().unwrap_or_default().to_owned();
    Ok(Some((method, path)))
}

/// Reads one request and answers it; the connection closes after.
async fn answer(mut stream: TcpStream, routes: &Routes) -> std::io::Result<()> {
    let Ok(request) = tokio::time::timeout(Duration::from_secs(5), read_request(&mut stream)).await
    else {
        return Ok(());
    };
    let Some((method, path)) = request? else {
        return Ok(());
    };
    let (status, content_type, body) = match (method.as_str(), path.as_str(), routes) {
        (
            "GET",
            "/metrics",
            Routes {
                metrics: Some(registry),
                ..
            },
        ) => {
            let mut text = String::new();
            encode(&mut text, registry).map_err(std::io::Error::other)?;
            let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
            ("200 OK", kind, text)
        }
        (
            "GET",
            "/",
            Routes {
                dashboard: Some(_), ..
            },
        ) => (
            "200 OK",
            "text/html; charset=utf-8",
            DASHBOARD_PAGE.to_owned(),
        ),
        (
            "GET",
            "/state",
            Routes {
                dashboard: Some(state),
                ..
            },
        ) => {
            let json = state.borrow().as_str().to_owned();
            ("200 OK", "application/json", json)
        }
        (
            "GET",
            "/events",
            Routes {
                dashboard: Some(state),
                ..
            },
        ) => {
            return events(stream, state.clone()).await;
        }
        ("GET", _, _) => ("404 Not Found", "text/plain", "not found\n".to_owned()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_owned(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         cache-control: no-store\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// Server-sent events: every new snapshot, the latest only (a slow client skips the ones it
/// could not take), until the client goes or the peer ends.
async fn events(
    mut stream: TcpStream,
    mut state: watch::Receiver<Arc<String>>,
) -> std::io::Result<()> {
    stream
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-store\r\n\
              connection: close\r\n\r\n",
        )
        .await?;
    loop {
        let snapshot = state.borrow_and_update().clone();
        stream
            .write_all(format!("data: {snapshot}\n\n").as_bytes())
            .await?;
        if state.changed().await.is_err() {
            return Ok(());
        }
    }
}
