//! Tensor transport: one framed message per QUIC stream, on the libp2p connection to the peer
//! (`/shoal/tensor/1`: NAT traversal and PeerId authentication come for free) or on the direct
//! endpoint (`direct.rs`); both kinds of stream go through the same [`Admission`].
//!
//! The sender opens a stream, writes the frame and waits for a one-byte acknowledgement; the
//! receiver reads the 12-byte frame header, checks it against the caps before allocating, reads
//! exactly the payload and acknowledges. Every resource a peer can make us hold is bounded:
//! streams per peer and in total, the frame size, the bytes of received frames not yet consumed
//! by the application, and the time a stream may take. A peer that breaks a rule has its stream
//! reset and the reason logged at `warn` with its PeerId.

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, StreamExt};
use libp2p::{PeerId, StreamProtocol};
use libp2p_stream::{Control, IncomingStreams};
use shoal_protocol::wire::{FRAME_HEADER_LEN, FrameHeader, FrameKind, FrameLimits};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// The protocol id of tensor streams (major version 1).
pub const TENSOR_PROTOCOL: StreamProtocol = StreamProtocol::new("/shoal/tensor/1");

/// Byte the receiver sends back once a frame has been read completely.
const ACK: u8 = 0x06;

/// Caps on what peers can make this node hold.
#[derive(Clone, Copy, Debug)]
pub struct TransportLimits {
    /// Frame size caps.
    pub frames: FrameLimits,
    /// Inbound tensor streams open at once from one peer.
    pub streams_per_peer: usize,
    /// Inbound tensor streams open at once in total: the least; raised to what the run needs
    /// ([`super::NodeHandle::need_peers`]).
    pub streams_total: usize,
    /// Bytes of received frames held (being read or queued for the application) at once.
    pub queued_bytes: usize,
    /// Grace period of a stream: time for its header, and before its rate is judged.
    pub base_timeout: Duration,
    /// Slowest acceptable average rate of a frame's payload after the grace period; a slower
    /// stream is cut (slow-loris defence). What a stream holds meanwhile is only what it sent.
    pub min_rate_bytes_per_s: u64,
}

impl Default for TransportLimits {
    fn default() -> Self {
        TransportLimits {
            frames: FrameLimits::default(),
            streams_per_peer: 8,
            streams_total: 64,
            // Two maximal frames: enough to keep a fast link busy, small enough for any host.
            queued_bytes: 2 * FrameLimits::default().max_tensor_len as usize,
            base_timeout: Duration::from_secs(10),
            // 1 Mbit/s: a home uplink shared by several streams stays well above it.
            min_rate_bytes_per_s: 128 << 10,
        }
    }
}

impl TransportLimits {
    fn timeout_for(&self, len: usize) -> Duration {
        self.base_timeout + Duration::from_secs(len as u64 / self.min_rate_bytes_per_s.max(1))
    }
}

/// A frame received from a peer. Holding it holds its share of the queued-bytes budget.
#[derive(Debug)]
pub struct InboundFrame {
    /// Who sent it (authenticated by the connection).
    pub peer: PeerId,
    /// Control or tensor.
    pub kind: FrameKind,
    /// The payload (a postcard control message or a tensor message).
    pub payload: Vec<u8>,
    _budget: Option<OwnedSemaphorePermit>,
}

/// Why sending failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The stream could not be opened (peer unreachable, protocol unsupported).
    #[error("cannot open a tensor stream to {peer}: {reason}")]
    Open {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    /// The transfer broke off or was refused.
    #[error("tensor transfer to {peer} failed: {source}")]
    Io {
        /// The peer.
        peer: PeerId,
        /// The error.
        source: std::io::Error,
    },
    /// The frame is larger than any peer accepts.
    #[error("frame of {0} bytes exceeds the tensor frame cap")]
    TooLarge(usize),
}

impl SendError {
    /// Whether the receiver dropped the stream before taking the frame: QUIC's STOP_SENDING or
    /// RESET_STREAM (quinn reports both as `ConnectionReset`), or the stream's end without an
    /// acknowledgement (a dropped quinn stream finishes its sending half). A receiver delivers
    /// a frame only after acknowledging it, so such a frame was not delivered.
    pub fn refused_unread(&self) -> bool {
        use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
        matches!(self, SendError::Io { source, .. } if matches!(source.kind(), ConnectionReset | UnexpectedEof))
    }
}

/// Sends one frame to `peer` on a new libp2p stream and waits for its acknowledgement.
/// Dropping the future cancels the transfer (the stream is reset).
pub async fn send_frame(
    control: &mut Control,
    peer: PeerId,
    kind: FrameKind,
    payload: &[u8],
    limits: &TransportLimits,
) -> Result<(), SendError> {
    check_sendable(payload, limits)?;
    let mut stream = open_stream(control, peer).await?;
    write_frame(&mut stream, kind, payload, limits)
        .await
        .map_err(|source| SendError::Io { peer, source })
}

/// Whether any peer would accept a frame of this size.
pub fn check_sendable(payload: &[u8], limits: &TransportLimits) -> Result<(), SendError> {
    match u32::try_from(payload.len()) {
        Ok(len) if len <= limits.frames.max_tensor_len => Ok(()),
        _ => Err(SendError::TooLarge(payload.len())),
    }
}

/// Writes one frame on `stream` and waits for the receiver's acknowledgement.
pub async fn write_frame<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    kind: FrameKind,
    payload: &[u8],
    limits: &TransportLimits,
) -> std::io::Result<()> {
    let len = payload.len() as u32;
    let transfer = async {
        stream
            .write_all(&FrameHeader { kind, len }.to_bytes())
            .await?;
        stream.write_all(payload).await?;
        stream.flush().await?;
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).await?;
        if ack[0] != ACK {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "bad acknowledgement",
            ));
        }
        // Acknowledged: the frame is delivered. The receiver may already have dropped its end
        // (QUIC then answers our close with STOP_SENDING), which is no failure.
        let _ = stream.close().await;
        Ok(())
    };
    match tokio::time::timeout(limits.timeout_for(payload.len()), transfer).await {
        Ok(result) => result,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "transfer timed out",
        )),
    }
}

/// How long opening a stream (dialling included) may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Attempts at opening a stream before giving up.
const OPEN_ATTEMPTS: u32 = 3;

/// Opens a raw tensor stream to `peer` (what [`send_frame`] writes a frame on).
///
/// Opening can fail for reasons that a second try fixes: two peers that dialed each other at
/// once hold two connections until one is closed, and a stream requested on the closing one is
/// cancelled. Nothing has been sent at that point, so retrying is safe.
pub async fn open_stream(control: &mut Control, peer: PeerId) -> Result<libp2p::Stream, SendError> {
    let mut attempt = 1;
    loop {
        // Opening may dial the peer; bound the wait like every other step of a transfer.
        let open = tokio::time::timeout(OPEN_TIMEOUT, control.open_stream(peer, TENSOR_PROTOCOL));
        let Ok(opened) = open.await else {
            return Err(SendError::Open {
                peer,
                reason: "timed out".into(),
            });
        };
        match opened {
            Ok(stream) => return Ok(stream),
            Err(libp2p_stream::OpenStreamError::Io(e)) if attempt < OPEN_ATTEMPTS => {
                tracing::debug!(%peer, attempt, "opening a tensor stream failed, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(50 * attempt as u64)).await;
                attempt += 1;
            }
            Err(e) => {
                return Err(SendError::Open {
                    peer,
                    reason: e.to_string(),
                });
            }
        }
    }
}

/// Admits inbound tensor streams (from libp2p or the direct endpoint) under one set of caps
/// and delivers complete frames to a bounded channel (a slow application slows senders down).
#[derive(Clone)]
pub struct Admission {
    limits: TransportLimits,
    /// `limits.streams_total`, raised as the run grows ([`Admission::set_streams_total`]).
    streams_total: Arc<AtomicUsize>,
    open: Arc<Mutex<HashMap<PeerId, usize>>>,
    budget: Arc<Semaphore>,
    deliver: mpsc::Sender<InboundFrame>,
}

impl Admission {
    /// Admission under `limits`, delivering to `deliver`.
    pub fn new(limits: TransportLimits, deliver: mpsc::Sender<InboundFrame>) -> Self {
        Admission {
            limits,
            streams_total: Arc::new(AtomicUsize::new(limits.streams_total)),
            open: Arc::default(),
            budget: Arc::new(Semaphore::new(
                limits.queued_bytes.min(Semaphore::MAX_PERMITS),
            )),
            deliver,
        }
    }

    /// Admits up to `streams` inbound streams at once in total from now on.
    pub fn set_streams_total(&self, streams: usize) {
        self.streams_total.store(streams, Ordering::Relaxed);
    }

    /// Takes a new inbound stream from `peer`: refused (dropped, so reset) beyond the stream
    /// caps, otherwise read on its own task.
    pub fn admit<S>(&self, peer: PeerId, mut stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let admitted = {
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            let total: usize = open.values().sum();
            let mine = open.entry(peer).or_insert(0);
            let cap = self.streams_total.load(Ordering::Relaxed);
            if *mine >= self.limits.streams_per_peer || total >= cap {
                false
            } else {
                *mine += 1;
                true
            }
        };
        if !admitted {
            tracing::warn!(%peer, "tensor stream refused: too many open streams; resetting it");
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let budget = this.budget.clone();
            if let Err(reason) =
                receive_one(peer, &mut stream, &this.limits, budget, &this.deliver).await
            {
                tracing::warn!(%peer, %reason, "tensor stream reset");
            }
            drop(stream);
            let mut open = this.open.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = open.get_mut(&peer) {
                *n -= 1;
                if *n == 0 {
                    open.remove(&peer);
                }
            }
        });
    }
}

/// Admits every inbound libp2p tensor stream until `incoming` ends.
pub async fn accept_frames(mut incoming: IncomingStreams, admission: Admission) {
    while let Some((peer, stream)) = incoming.next().await {
        admission.admit(peer, stream);
    }
}

/// Bytes read (and reserved from the receive budget) at a time.
const CHUNK: usize = 1 << 20;

/// Reads a `len`-byte payload. Memory and the receive budget follow the bytes that actually
/// arrive, a chunk at a time, never the size the header claims; and after a grace period of
/// `base_timeout` the stream must keep up `min_rate_bytes_per_s` on average, or it is cut
/// (a sender that claims a large frame and trickles it holds little and not for long).
async fn read_payload<S: AsyncRead + Unpin>(
    stream: &mut S,
    len: usize,
    limits: &TransportLimits,
    budget: &Arc<Semaphore>,
) -> Result<(Vec<u8>, Option<OwnedSemaphorePermit>), String> {
    let start = tokio::time::Instant::now();
    let rate = limits.min_rate_bytes_per_s.max(1) as f64;
    let mut payload = Vec::new();
    let mut permit: Option<OwnedSemaphorePermit> = None;
    while payload.len() < len {
        let from = payload.len();
        let to = (from + CHUNK).min(len);
        // Waiting for budget (the application is behind) counts against the deadline too:
        // the sender is held either way.
        let deadline = start + limits.base_timeout + Duration::from_secs_f64(to as f64 / rate);
        let more = tokio::time::timeout_at(
            deadline,
            budget.clone().acquire_many_owned((to - from) as u32),
        )
        .await
        .map_err(|_| format!("frame of {len} bytes: receive budget exhausted for too long"))?
        .map_err(|_| "receiver shutting down".to_string())?;
        match &mut permit {
            Some(p) => p.merge(more),
            None => permit = Some(more),
        }
        payload.resize(to, 0);
        tokio::time::timeout_at(deadline, stream.read_exact(&mut payload[from..]))
            .await
            .map_err(|_| {
                format!("frame of {len} bytes: {from} received, slower than the minimum rate")
            })?
            .map_err(|e| format!("reading {len}-byte payload: {e}"))?;
    }
    Ok((payload, permit))
}

async fn receive_one<S: AsyncRead + AsyncWrite + Unpin>(
    peer: PeerId,
    stream: &mut S,
    limits: &TransportLimits,
    budget: Arc<Semaphore>,
    deliver: &mpsc::Sender<InboundFrame>,
) -> Result<(), String> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    tokio::time::timeout(limits.base_timeout, stream.read_exact(&mut header))
        .await
        .map_err(|_| "no frame header in time".to_string())?
        .map_err(|e| format!("reading frame header: {e}"))?;
    let header = FrameHeader::parse(&header, &limits.frames).map_err(|e| e.to_string())?;
    let len = header.len as usize;
    let (payload, permit) = read_payload(stream, len, limits, &budget).await?;
    stream
        .write_all(&[ACK])
        .await
        .map_err(|e| format!("acknowledging: {e}"))?;
    let _ = stream.close().await;
    deliver
        .send(InboundFrame {
            peer,
            kind: header.kind,
            payload,
            _budget: permit,
        })
        .await
        .map_err(|_| "application stopped receiving".to_string())
}
