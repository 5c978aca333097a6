//! Modelled links.
//!
//! Every peer has an access link with an upload and a download direction. A message from A to
//! B is serialised on A's uplink (a queue: it starts when the messages before it have left),
//! crosses the path's one-way latency, and is received on B's downlink (another queue);
//! uplink and downlink pipeline, so an idle path delivers `size` bytes after
//! `latency + size / min(up_A, down_B)`. The path's latency is the mean of the two access
//! latencies (a preset names the one-way latency between two peers of its kind), plus jitter
//! drawn per message. Loss is modelled as its cost on a reliable stream: a message that loses a
//! packet is delivered one round trip later (QUIC retransmits within the stream). `hostile`
//! links have latency spikes: now and then, for a few seconds, everything through the link is
//! delayed by more than a second.

use shoal_protocol::swarm::SeededRng;

/// A link preset: one-way latency (a range: each peer draws its own), bandwidth per direction,
/// jitter, loss and spikes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkProfile {
    /// Preset name.
    pub name: &'static str,
    /// One-way latency range, seconds.
    pub latency: (f64, f64),
    /// Upload bits per second.
    pub up_bps: f64,
    /// Download bits per second.
    pub down_bps: f64,
    /// Extra delay per message, uniform in [0, jitter], seconds.
    pub jitter: f64,
    /// Packet loss probability.
    pub loss: f64,
    /// Mean seconds between latency spikes (0: none).
    pub spike_every: f64,
    /// Spike length range, seconds.
    pub spike_len: (f64, f64),
    /// Extra one-way delay during a spike, seconds.
    pub spike_delay: f64,
}

const fn link(name: &'static str, latency: (f64, f64), up: f64, down: f64) -> LinkProfile {
    LinkProfile {
        name,
        latency,
        up_bps: up,
        down_bps: down,
        jitter: 0.0,
        loss: 0.0,
        spike_every: 0.0,
        spike_len: (0.0, 0.0),
        spike_delay: 0.0,
    }
}

/// The link presets.
pub const LINKS: [LinkProfile; 6] = [
    LinkProfile {
        jitter: 0.000_02,
        ..link("datacenter", (0.000_1, 0.000_1), 100e9, 100e9)
    },
    LinkProfile {
        jitter: 0.000_2,
        ..link("metro", (0.002, 0.002), 10e9, 10e9)
    },
    LinkProfile {
        jitter: 0.002,
        ..link("us-regions", (0.011, 0.067), 1e9, 1e9)
    },
    LinkProfile {
        jitter: 0.005,
        ..link("intercontinental", (0.076, 0.265), 0.33e9, 0.8e9)
    },
    LinkProfile {
        jitter: 0.005,
        loss: 0.005,
        ..link("home", (0.030, 0.030), 110e6, 500e6)
    },
    LinkProfile {
        jitter: 0.020,
        loss: 0.01,
        spike_every: 60.0,
        spike_len: (1.0, 4.0),
        spike_delay: 1.5,
        ..link("hostile", (0.150, 0.150), 80e6, 80e6)
    },
];

/// Bytes per QUIC packet payload, for counting packets that may be lost.
const PACKET: f64 = 1200.0;

impl LinkProfile {
    /// The preset called `name`.
    pub fn named(name: &str) -> Result<LinkProfile, String> {
        crate::preset(&LINKS, name, "link", |l| l.name)
    }
}

/// One peer's access link, with its queues.
#[derive(Clone, Debug)]
pub struct AccessLink {
    /// The preset.
    pub profile: LinkProfile,
    /// This peer's one-way latency, drawn from the preset's range.
    pub latency: f64,
    /// When the uplink is free again.
    up_free: f64,
    /// When the downlink is free again.
    down_free: f64,
    /// The current or next latency spike, [start, end).
    spike: (f64, f64),
    rng: SeededRng,
}

impl AccessLink {
    /// An access link of `profile`, its latency and spikes drawn from `rng`.
    pub fn new(profile: LinkProfile, rng: &mut SeededRng) -> Self {
        let (lo, hi) = profile.latency;
        let latency = lo + (hi - lo) * rng.next_f64();
        let mut link = AccessLink {
            profile,
            latency,
            up_free: 0.0,
            down_free: 0.0,
            spike: (f64::INFINITY, f64::INFINITY),
            rng: SeededRng::new(rng.next_u64()),
        };
        link.spike = link.next_spike(0.0);
        link
    }

    fn next_spike(&mut self, after: f64) -> (f64, f64) {
        let p = self.profile;
        if p.spike_every <= 0.0 {
            return (f64::INFINITY, f64::INFINITY);
        }
        // Exponential gaps: a Poisson process of spikes.
        let gap = -p.spike_every * (1.0 - self.rng.next_f64()).ln();
        let len = p.spike_len.0 + (p.spike_len.1 - p.spike_len.0) * self.rng.next_f64();
        (after + gap, after + gap + len)
    }

    /// Extra delay for traffic through this link at time `t` (a spike, if one is on).
    fn spike_delay(&mut self, t: f64) -> f64 {
        while self.spike.1 <= t {
            self.spike = self.next_spike(self.spike.1);
        }
        if self.spike.0 <= t {
            self.profile.spike_delay
        } else {
            0.0
        }
    }
}

/// Messages up to this size do not wait behind the bulk transfers queued on a link: QUIC
/// multiplexes streams, so a small message's few packets go out between a large transfer's
/// (the node sends every message on a stream of its own). They still take their share of the
/// bandwidth.
pub const SMALL_MESSAGE: u64 = 16 * 1024;

/// When a message of `bytes` sent at `now` from `from` arrives at `to`; updates both queues.
pub fn deliver(now: f64, bytes: u64, from: &mut AccessLink, to: &mut AccessLink) -> f64 {
    let size = bytes as f64 * 8.0;
    let latency = (from.latency + to.latency) / 2.0;
    let (up_time, down_time) = (size / from.profile.up_bps, size / to.profile.down_bps);
    let down_end = if bytes <= SMALL_MESSAGE {
        // Interleaved: its own serialisation only, and the queues are pushed back by as much.
        from.up_free = from.up_free.max(now) + up_time;
        to.down_free = to.down_free.max(now + latency) + down_time;
        now + up_time.max(down_time) + latency
    } else {
        let up_start = now.max(from.up_free);
        let up_end = up_start + up_time;
        from.up_free = up_end;
        let down_start = (up_start + latency).max(to.down_free);
        let down_end = (down_start + down_time).max(up_end + latency);
        to.down_free = down_end;
        down_end
    };
    let mut extra = 0.0;
    let jitter = from.profile.jitter.max(to.profile.jitter);
    if jitter > 0.0 {
        extra += jitter * from.rng.next_f64();
    }
    let loss = 1.0 - (1.0 - from.profile.loss) * (1.0 - to.profile.loss);
    if loss > 0.0 {
        let packets = (bytes as f64 / PACKET).ceil().max(1.0);
        let delivered_clean = (1.0 - loss).powf(packets);
        if from.rng.next_f64() >= delivered_clean {
            extra += 2.0 * latency;
        }
    }
    extra += from.spike_delay(now) + to.spike_delay(now);
    down_end + extra
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(name: &str) -> LinkProfile {
        LinkProfile {
            jitter: 0.0,
            loss: 0.0,
            spike_every: 0.0,
            ..LinkProfile::named(name).unwrap()
        }
    }

    /// One transfer on idle links: latency plus size over the narrower direction.
    #[test]
    fn an_idle_path_delivers_after_latency_plus_serialisation() {
        let mut rng = SeededRng::new(1);
        let mut home = AccessLink::new(fixed("home"), &mut rng);
        let mut dc = AccessLink::new(fixed("datacenter"), &mut rng);
        let bytes = 1_000_000u64;
        // Home uplink (110 Mbit/s) is the bottleneck; one-way latency (30 + 0.1) / 2 ms.
        let t = deliver(10.0, bytes, &mut home, &mut dc);
        let want = 10.0 + 0.030_1 / 2.0 + 8e6 / 110e6;
        assert!((t - want).abs() < 1e-12, "{t} vs {want}");
        // Back the other way the home downlink (500 Mbit/s) is.
        let t = deliver(20.0, bytes, &mut dc, &mut home);
        let want = 20.0 + 0.030_1 / 2.0 + 8e6 / 500e6;
        assert!((t - want).abs() < 1e-12, "{t} vs {want}");
    }

    /// Messages queue on a shared uplink: the second leaves when the first has left.
    #[test]
    fn a_busy_uplink_queues_transfers() {
        let mut rng = SeededRng::new(1);
        let mut a = AccessLink::new(fixed("home"), &mut rng);
        let mut b = AccessLink::new(fixed("home"), &mut rng);
        let mut c = AccessLink::new(fixed("home"), &mut rng);
        let bytes = 1_375_000u64; // 0.1 s on a 110 Mbit/s uplink
        let first = deliver(0.0, bytes, &mut a, &mut b);
        let second = deliver(0.0, bytes, &mut a, &mut c);
        assert!((first - (0.1 + 0.030)).abs() < 1e-9, "{first}");
        assert!((second - (0.2 + 0.030)).abs() < 1e-9, "{second}");
        // A downlink shared by two senders queues as well: 500 Mbit/s, 11 Mbit each.
        let mut d = AccessLink::new(fixed("datacenter"), &mut rng);
        let mut e = AccessLink::new(fixed("datacenter"), &mut rng);
        let t1 = deliver(1.0, bytes, &mut d, &mut c);
        let t2 = deliver(1.0, bytes, &mut e, &mut c);
        let one = 11e6 / 500e6;
        assert!((t2 - t1 - one).abs() < 1e-9, "{t1} {t2}");
    }

    /// A small message (an announcement, a commit) overtakes a bulk transfer queued on the
    /// same links, as QUIC's streams interleave, and pushes it back by its own size.
    #[test]
    fn a_small_message_does_not_wait_behind_a_bulk_transfer() {
        let mut rng = SeededRng::new(1);
        let mut a = AccessLink::new(fixed("home"), &mut rng);
        let mut b = AccessLink::new(fixed("home"), &mut rng);
        let bulk = 13_750_000u64; // 1 s on a 110 Mbit/s uplink
        let t_bulk = deliver(0.0, bulk, &mut a, &mut b);
        let small = 1_000u64;
        let t_small = deliver(0.0, small, &mut a, &mut b);
        let serialise = 8e3 / 110e6;
        assert!((t_small - (0.030 + serialise)).abs() < 1e-9, "{t_small}");
        // The next bulk transfer leaves after both.
        let t_next = deliver(0.0, bulk, &mut a, &mut b);
        assert!(
            (t_next - (t_bulk + 1.0 + serialise)).abs() < 1e-9,
            "{t_bulk} {t_next}"
        );
    }

    #[test]
    fn loss_and_spikes_only_ever_delay() {
        let mut rng = SeededRng::new(9);
        let mut a = AccessLink::new(LinkProfile::named("hostile").unwrap(), &mut rng);
        let mut b = AccessLink::new(LinkProfile::named("hostile").unwrap(), &mut rng);
        let mut late = 0;
        for i in 0..2000 {
            let now = i as f64 * 0.5;
            let t = deliver(now, 100, &mut a, &mut b);
            let floor = now + 0.150;
            assert!(t >= floor - 1e-12);
            if t > floor + 1.0 {
                late += 1;
            }
        }
        assert!(late > 0, "hostile links have spikes");
    }

    #[test]
    fn presets_are_found() {
        for l in LINKS {
            assert_eq!(LinkProfile::named(l.name), Ok(l));
        }
        assert!(LinkProfile::named("dialup").is_err());
    }
}
