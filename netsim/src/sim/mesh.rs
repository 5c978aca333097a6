//! Gossip as it travels: the gossipsub mesh the node publishes announcements into.
//!
//! Each peer keeps [`MESH_N`] mesh neighbours (grafting more when fewer than [`MESH_N_LOW`]
//! are reachable, refusing a graft past [`MESH_N_HIGH`], as gossipsub's heartbeat does). A
//! published message floods the mesh: every peer forwards it once, on first receipt, to each
//! mesh neighbour but the one it came from and its origin, so a peer's uplink carries up to
//! `MESH_N - 1` copies of every message of the swarm, duplicates included; and every peer that
//! holds it advertises its id to [`GOSSIP_LAZY`] other peers in each of [`HISTORY_GOSSIP`]
//! heartbeats (IHAVE). The flood is computed when the message is published (each hop's delay
//! from the link model, the earliest path to each peer winning); each peer receives it once,
//! at that time, from the neighbour on that path.

use super::*;

/// Mesh neighbours a peer keeps (gossipsub's `mesh_n`).
pub const MESH_N: usize = 6;
/// Below this many reachable neighbours a peer grafts more (`mesh_n_low`).
pub const MESH_N_LOW: usize = 5;
/// A peer refuses grafts past this many neighbours (`mesh_n_high`).
pub const MESH_N_HIGH: usize = 12;
/// Peers outside its mesh a peer sends message ids to each heartbeat (`gossip_lazy`).
pub const GOSSIP_LAZY: u64 = 6;
/// Heartbeats a message's id is advertised for (`history_gossip`).
pub const HISTORY_GOSSIP: u64 = 3;
/// Bytes of one message id in an IHAVE: the node's ids are 8-byte hashes, in protobuf
/// framing.
pub const MESSAGE_ID: u64 = 10;
/// Bytes gossipsub adds to a published message: the origin's peer id, a sequence number,
/// the topic and a signature, in protobuf framing.
pub const GOSSIP_OVERHEAD: u64 = 140;

/// Who is in whose mesh. Links are symmetric; a dead peer's are dropped, a cut-off one's kept
/// (it is back after a heal).
#[derive(Debug)]
pub(super) struct Mesh {
    links: Vec<Vec<usize>>,
    /// Its own generator: the mesh's draws leave the simulation's other draws as they were.
    rng: SeededRng,
}

impl Mesh {
    pub fn new(seed: u64) -> Self {
        Mesh {
            links: Vec::new(),
            rng: SeededRng::new(seed ^ 0x6d65_7368),
        }
    }

    /// Peer `p`'s neighbours that `usable` accepts, grafting among `candidates` first if it
    /// has fewer than [`MESH_N_LOW`] of them; forgets those that `alive` rejects.
    pub fn neighbours(
        &mut self,
        p: usize,
        alive: impl Fn(usize) -> bool,
        usable: impl Fn(usize) -> bool,
        candidates: impl FnOnce() -> Vec<usize>,
    ) -> Vec<usize> {
        self.hold(p);
        let dead: Vec<usize> = self.links[p]
            .iter()
            .copied()
            .filter(|&q| !alive(q))
            .collect();
        for q in dead {
            self.unlink(p, q);
        }
        let mut mine: Vec<usize> = self.links[p]
            .iter()
            .copied()
            .filter(|&q| usable(q))
            .collect();
        if mine.len() < MESH_N_LOW {
            let mut pool: Vec<usize> = candidates()
                .into_iter()
                .filter(|&q| q != p && !self.links[p].contains(&q))
                .collect();
            while mine.len() < MESH_N && !pool.is_empty() {
                let q = pool.swap_remove((self.rng.next_u64() % pool.len() as u64) as usize);
                let theirs = self.links.get(q).map_or(0, Vec::len);
                if theirs < MESH_N_HIGH {
                    self.link(p, q);
                    mine.push(q);
                }
            }
        }
        mine
    }

    /// Makes room for peer `p`'s links.
    fn hold(&mut self, p: usize) {
        if self.links.len() <= p {
            self.links.resize(p + 1, Vec::new());
        }
    }

    fn link(&mut self, a: usize, b: usize) {
        self.hold(a.max(b));
        self.links[a].push(b);
        self.links[b].push(a);
    }

    fn unlink(&mut self, a: usize, b: usize) {
        self.links[a].retain(|&q| q != b);
        if let Some(theirs) = self.links.get_mut(b) {
            theirs.retain(|&q| q != a);
        }
    }
}

/// A heap entry of the flood: a peer reached at `at` (ns).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Reached {
    at: std::cmp::Reverse<u64>,
    peer: usize,
}

impl Sim {
    /// Publishes `origin`'s announcement into the mesh from `publisher` (the origin itself,
    /// or the attacker that speaks for a sybil identity): charges every copy the flood sends
    /// and schedules its arrival at every peer it reaches.
    pub(super) fn publish(
        &mut self,
        publisher: usize,
        origin: usize,
        a: shoal_protocol::swarm::Announcement,
    ) {
        let msg = Message::Announce(a);
        let env = Envelope { run: self.run, msg };
        let bytes = (env.to_bytes().len() + FRAME_HEADER_LEN) as u64 + GOSSIP_OVERHEAD;
        let now = self.now_s();
        let n = self.peers.len();
        let mut best = vec![u64::MAX; n];
        let mut via = vec![usize::MAX; n];
        let mut done = vec![false; n];
        let mut heap = BinaryHeap::new();
        best[publisher] = self.now;
        heap.push(Reached {
            at: std::cmp::Reverse(self.now),
            peer: publisher,
        });
        let mut sent = 0u64;
        while let Some(Reached { at, peer: u }) = heap.pop() {
            if done[u] {
                continue;
            }
            done[u] = true;
            let side = self.peers[u].side;
            let peers = &self.peers;
            let relay = |q: usize| !peers[q].sybil;
            let alive = |q: usize| peers[q].alive() && relay(q);
            let usable = |q: usize| alive(q) && peers[q].side == side;
            let candidates = || (0..n).filter(|&q| usable(q)).collect();
            let next = self.mesh.neighbours(u, alive, usable, candidates);
            for v in next {
                if v == via[u] || v == origin {
                    continue;
                }
                let (from, to) = pair(&mut self.peers, u, v);
                let arrival = deliver(now, bytes, &mut from.link, &mut to.link);
                sent += bytes;
                let t = at.0 + (ns(arrival) - self.now);
                if t < best[v] {
                    best[v] = t;
                    via[v] = u;
                    heap.push(Reached {
                        at: std::cmp::Reverse(t),
                        peer: v,
                    });
                }
            }
        }
        let reached = done.iter().filter(|d| **d).count() as u64;
        let ihave = reached * GOSSIP_LAZY * HISTORY_GOSSIP * MESSAGE_ID;
        self.gossip_bytes += sent + ihave;
        for v in 0..n {
            if done[v] && v != publisher && v != origin {
                let ev = Ev::Gossip {
                    to: v,
                    via: via[v],
                    origin,
                    msg: env.msg.clone(),
                };
                self.schedule(best[v], ev);
            }
        }
    }
}
