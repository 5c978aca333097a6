//! What this peer measured of its links to others, and the codec it sends each stage-boundary
//! hop with.
//!
//! The owner reports how long each message took from being handed to the transport to its
//! receiver's acknowledgement, and the round-trip time of each connection (libp2p's ping; the
//! link model in netsim). A message's transfer time is its delivery time less one round trip;
//! the link's rate is a moving average of bytes over transfer time for large messages. It is
//! the rate this peer gets to that receiver with its other traffic on the same uplink (a busy
//! uplink queues messages, so a saturated link measures slow): what a choice of codec changes.
//!
//! The choice ([`Links::choose`]): a hop's light codec while sending it takes at most half of
//! what this stage's device takes per microbatch (a replica's uplink carries an activation
//! forward and an activation gradient back for each microbatch it computes, so at half each
//! the link keeps pace with the device), its strong codec once it takes more; back to light
//! only below a quarter, so that the lighter load a strong codec leaves on the link does not
//! flip the choice back at once. Nothing measured yet: light.

use std::collections::HashMap;
use std::time::Duration;

use super::PeerKey;
use crate::{Codec, HopCodec};

/// Messages from this size on measure the rate (smaller ones are mostly round trip).
pub const RATE_SAMPLE_BYTES: u64 = 32 * 1024;

/// Seconds per byte of an uplink not measured yet: a slow home uplink's, 10 Mbit/s. What
/// waits on it (an averaging round) waits too long only when a peer is silently gone; too
/// short, it gives up on every peer.
pub const UNMEASURED_PACE: f64 = 8.0 / 10e6;

/// Weight of a new rate sample in the moving average.
const RATE_WEIGHT: f64 = 0.25;

/// Links tracked at most (one per peer this peer sends to; past it, new peers are not
/// measured and get their hop's light codec).
const MAX_LINKS: usize = 4096;

/// The strong codec is kept until a light encoding would take under this fraction of the
/// budget.
const BACK_TO_LIGHT: f64 = 0.5;

#[derive(Clone, Debug, Default)]
struct Link {
    /// Smallest round trip seen.
    rtt: Option<Duration>,
    /// Seconds per byte, moving average over large messages.
    secs_per_byte: Option<f64>,
    /// The hop is sent with its strong codec.
    strong: bool,
}

/// Measured links, by peer.
#[derive(Debug, Default)]
pub struct Links {
    links: HashMap<PeerKey, Link>,
}

impl Links {
    fn link(&mut self, peer: PeerKey) -> Option<&mut Link> {
        if self.links.len() >= MAX_LINKS && !self.links.contains_key(&peer) {
            return None;
        }
        Some(self.links.entry(peer).or_default())
    }

    /// A round trip to `peer` was measured.
    pub fn rtt(&mut self, peer: PeerKey, rtt: Duration) {
        if let Some(l) = self.link(peer) {
            l.rtt = Some(l.rtt.map_or(rtt, |r| r.min(rtt)));
        }
    }

    /// A message of `bytes` reached `peer`, `elapsed` after it was handed to the transport.
    pub fn delivered(&mut self, peer: PeerKey, bytes: u64, elapsed: Duration) {
        let Some(l) = self.link(peer) else {
            return;
        };
        // A delivery takes at least a round trip; with none measured yet, it is the only
        // bound there is, and no transfer time can be told from it.
        let Some(rtt) = l.rtt else {
            l.rtt = Some(elapsed);
            return;
        };
        l.rtt = Some(rtt.min(elapsed));
        if bytes < RATE_SAMPLE_BYTES {
            return;
        }
        // Seconds per byte are averaged, not bytes per second: a transfer that looks instant
        // (jitter on a fast link) then counts as fast, not as infinitely fast.
        let sample = elapsed.saturating_sub(rtt).as_secs_f64() / bytes as f64;
        l.secs_per_byte = Some(match l.secs_per_byte {
            None => sample,
            Some(r) => r + RATE_WEIGHT * (sample - r),
        });
    }

    /// Seconds per byte this peer's sends take, the median over the links measured: its
    /// uplink's pace with the traffic it carries, robust to one slow receiver. Before any
    /// is measured (a one-stage run's first round sends nothing large before it),
    /// [`UNMEASURED_PACE`].
    pub fn upload_pace(&self) -> f64 {
        let mut paces: Vec<f64> = self
            .links
            .values()
            .filter_map(|l| l.secs_per_byte)
            .collect();
        if paces.is_empty() {
            return UNMEASURED_PACE;
        }
        paces.sort_by(f64::total_cmp);
        paces[paces.len() / 2]
    }

    /// Forgets `peer` (it left or was banned).
    pub fn forget(&mut self, peer: PeerKey) {
        self.links.remove(&peer);
    }

    /// Bytes per second measured to `peer`.
    pub fn rate(&self, peer: PeerKey) -> Option<f64> {
        let l = self.links.get(&peer)?;
        l.secs_per_byte.map(|s| 1.0 / s.max(f64::MIN_POSITIVE))
    }

    /// The codec of `hop` to send `values` to `peer` with, when this stage's device takes
    /// `per_microbatch` for a microbatch (None: not measured yet).
    pub fn choose(
        &mut self,
        peer: PeerKey,
        hop: HopCodec,
        values: usize,
        per_microbatch: Option<Duration>,
    ) -> Codec {
        if !hop.chooses() {
            return hop.light;
        }
        let (Some(budget), Some(l)) = (per_microbatch, self.links.get_mut(&peer)) else {
            return hop.light;
        };
        let Some(secs_per_byte) = l.secs_per_byte else {
            return hop.light;
        };
        let light_takes = values as f64 * hop.light.nominal_bits_per_value() / 8.0 * secs_per_byte;
        let budget = budget.as_secs_f64() / 2.0;
        if light_takes > budget {
            l.strong = true;
        } else if light_takes < BACK_TO_LIGHT * budget {
            l.strong = false;
        }
        if l.strong { hop.strong } else { hop.light }
    }

    /// Links tracked.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: PeerKey = PeerKey(7);
    const MS: Duration = Duration::from_millis(1);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// 110 Mbit/s with 60 ms round trips: a 1 MB message takes 60 ms + 72.7 ms.
    fn home(links: &mut Links) {
        links.rtt(P, 60 * MS);
        for _ in 0..20 {
            links.delivered(P, 1_000_000, secs(0.060 + 1e6 * 8.0 / 110e6));
        }
    }

    #[test]
    fn the_rate_is_bytes_over_delivery_time_less_a_round_trip() {
        let mut links = Links::default();
        home(&mut links);
        let rate = links.rate(P).unwrap();
        assert!((rate * 8.0 / 110e6 - 1.0).abs() < 1e-6, "{rate}");
        // Small messages say nothing of the rate, only of the round trip.
        links.delivered(P, 100, 40 * MS);
        assert_eq!(links.rate(P), Some(rate));
        assert_eq!(links.links[&P].rtt, Some(40 * MS));
    }

    /// The uplink's pace is the median link's: one receiver on a slow downlink does not make
    /// this peer's rounds wait as if its own uplink were slow.
    #[test]
    fn the_upload_pace_is_the_median_links() {
        let mut links = Links::default();
        assert_eq!(links.upload_pace(), UNMEASURED_PACE);
        for (peer, secs_per_mb) in [(1, 0.1), (2, 0.08), (3, 5.0)] {
            links.rtt(PeerKey(peer), 10 * MS);
            links.delivered(PeerKey(peer), 1_000_000, 10 * MS + secs(secs_per_mb));
        }
        let pace = links.upload_pace();
        assert!((pace * 1e6 - 0.1).abs() < 1e-9, "{pace}");
    }

    #[test]
    fn a_slow_link_gets_the_strong_codec_and_a_fast_one_the_light() {
        // 1 MB of int8 activations per microbatch; the device takes 100 ms per microbatch.
        let values = 1_000_000;
        let mut links = Links::default();
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, Some(100 * MS)),
            HopCodec::AUTO.light,
            "nothing measured"
        );
        home(&mut links);
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, Some(100 * MS)),
            HopCodec::AUTO.strong,
            "73 ms of sending a 100 ms microbatch"
        );
        // A device 4x slower: sending is now under a quarter of its time.
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, Some(400 * MS)),
            HopCodec::AUTO.light
        );
        let mut fast = Links::default();
        fast.rtt(P, MS);
        fast.delivered(P, 1_000_000, MS + secs(1e6 * 8.0 / 10e9));
        assert_eq!(
            fast.choose(P, HopCodec::AUTO, values, Some(100 * MS)),
            HopCodec::AUTO.light,
            "10 Gbit/s"
        );
        let fixed = HopCodec::fixed(Codec::Fp32);
        assert_eq!(links.choose(P, fixed, values, Some(MS)), Codec::Fp32);
    }

    #[test]
    fn the_strong_codec_stays_until_the_light_one_would_take_under_a_quarter() {
        let values = 1_000_000;
        let mut links = Links::default();
        home(&mut links);
        // 73 ms of a 120 ms microbatch: over half, strong.
        let budget = Some(120 * MS);
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, budget),
            HopCodec::AUTO.strong
        );
        // 73 ms of 200: under half but over a quarter, still strong; of 400, light again.
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, Some(200 * MS)),
            HopCodec::AUTO.strong
        );
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, Some(400 * MS)),
            HopCodec::AUTO.light
        );
        assert_eq!(
            links.choose(P, HopCodec::AUTO, values, Some(200 * MS)),
            HopCodec::AUTO.light
        );
    }

    #[test]
    fn links_are_bounded_and_forgotten() {
        let mut links = Links::default();
        for k in 0..MAX_LINKS as u64 + 10 {
            links.delivered(PeerKey(k), 1 << 20, 10 * MS);
        }
        assert_eq!(links.len(), MAX_LINKS);
        links.forget(PeerKey(0));
        assert_eq!(links.len(), MAX_LINKS - 1);
        // A delivery faster than the round trip measured counts as the fastest there is, and
        // a delivery before any round trip was measured only bounds the round trip.
        links.rtt(P, 50 * MS);
        links.delivered(P, 1 << 20, 10 * MS);
        assert!(links.rate(P).unwrap() > 1e300);
        let q = PeerKey(1 << 40);
        links.forget(PeerKey(1));
        links.delivered(q, 1 << 20, 10 * MS);
        assert_eq!((links.rate(q), links.links[&q].rtt), (None, Some(10 * MS)));
    }
}
