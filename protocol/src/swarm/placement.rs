//! Where peers serve: which stage a joiner takes (the emptiest, then the slowest per replica,
//! among those its memory fits) and whether one peer should move to balance the stages.

use super::PeerKey;

/// The device memory a stage needs of a peer: to hold all of it there, or, for a peer that
/// offloads, to hold what it computes with while its blocks wait in host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Need {
    /// Everything on the device.
    pub resident: u64,
    /// The blocks offloaded.
    pub offloaded: u64,
}

impl Need {
    /// What a peer with `memory` bytes of device memory (0: not limited) that `offloads` or
    /// not holds of this stage on its device: the resident need where that fits, else the
    /// offloaded one where it offloads; None if neither fits.
    pub fn on(&self, memory: u64, offloads: bool) -> Option<u64> {
        if memory == 0 || self.resident <= memory {
            Some(self.resident)
        } else if offloads && self.offloaded <= memory {
            Some(self.offloaded)
        } else {
            None
        }
    }
}

/// Whether a peer with `memory` bytes (0: not limited) that `offloads` or not can serve a
/// stage needing `need`.
pub fn fits(memory: u64, offloads: bool, need: Need) -> bool {
    need.on(memory, offloads).is_some()
}

/// One peer's place in the balance: its stage and its measured throughput there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placement {
    /// The peer.
    pub peer: PeerKey,
    /// Its stage.
    pub stage: u32,
    /// Samples per second at that stage (0 if not measured).
    pub throughput: f64,
    /// Device memory it can give a stage (0: not limited).
    pub memory: u64,
    /// Whether it can keep a stage's blocks in host memory (see [`Need`]).
    pub offloads: bool,
}

/// Per-stage throughput (samples/s summed over replicas) and replica counts.
pub fn stage_totals(placements: &[Placement], stages: u32) -> Vec<(f64, usize)> {
    let mut totals = vec![(0.0, 0usize); stages as usize];
    for p in placements {
        if let Some(t) = totals.get_mut(p.stage as usize) {
            t.0 += p.throughput;
            t.1 += 1;
        }
    }
    totals
}

/// The stage a joiner with `memory` bytes that `offloads` or not takes, among those it can
/// hold (`need`: per stage): one with no replica first, then the one with the least
/// throughput, then the fewest replicas, then the lowest index. None if no stage fits.
pub fn choose_stage(
    placements: &[Placement],
    need: &[Need],
    memory: u64,
    offloads: bool,
) -> Option<u32> {
    let totals = stage_totals(placements, need.len() as u32);
    let fitting: Vec<usize> = (0..need.len())
        .filter(|s| fits(memory, offloads, need[*s]))
        .collect();
    let mut best = *fitting.first()?;
    for &i in &fitting {
        let (t, b) = (totals[i], totals[best]);
        let key = |t: (f64, usize)| (t.1 > 0, t.0, t.1);
        let (ka, kb) = (key(t), key(b));
        let better = match (ka.0, kb.0) {
            (false, true) => true,
            (true, false) => false,
            _ => ka.1 < kb.1 || (ka.1 == kb.1 && ka.2 < kb.2),
        };
        if better {
            best = i;
        }
    }
    Some(best as u32)
}

/// A proposed move of one peer to another stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Move {
    /// Who moves.
    pub peer: PeerKey,
    /// From which stage.
    pub from: u32,
    /// To which stage.
    pub to: u32,
    /// The slowest stage's throughput before the move.
    pub before: f64,
    /// And after.
    pub after: f64,
}

/// Moves whose gain is within this fraction of the best move's gain count as equally good.
/// Peers measure throughput with noise and see each other's a gossip round late (in the
/// simulator, the views of four identical GPUs differed by up to 12%), so with similar
/// devices each would find a different best mover, and the peer chosen would rarely agree
/// that it is; among equally good moves, the smallest key moves.
pub const MOVE_TIE: f64 = 0.25;

/// The move that most raises the slowest stage's throughput, if one raises it by more than
/// `gain` (hysteresis: small improvements are not worth a state transfer and would make
/// peers flap between stages); of the moves within [`MOVE_TIE`] of the best, the smallest
/// key's. A peer's throughput at another stage is estimated by scaling with the stages' FLOPs
/// per sample. Only measured peers move; no move empties a stage; no peer moves to a stage
/// whose `need` of memory it cannot hold.
pub fn plan_move(
    placements: &[Placement],
    flops_per_sample: &[f64],
    need: &[Need],
    gain: f64,
) -> Option<Move> {
    let stages = flops_per_sample.len() as u32;
    let totals = stage_totals(placements, stages);
    if totals.iter().any(|t| t.1 == 0) || placements.iter().any(|p| p.throughput <= 0.0) {
        return None;
    }
    let slowest = |t: &[f64]| t.iter().copied().fold(f64::INFINITY, f64::min);
    let base: Vec<f64> = totals.iter().map(|t| t.0).collect();
    let before = slowest(&base);
    let mut moves = Vec::new();
    for p in placements {
        if totals[p.stage as usize].1 <= 1 {
            continue;
        }
        for to in 0..stages {
            let holds = |n: &Need| fits(p.memory, p.offloads, *n);
            if to == p.stage || !need.get(to as usize).is_some_and(holds) {
                continue;
            }
            let mut t = base.clone();
            t[p.stage as usize] -= p.throughput;
            let scale = flops_per_sample[p.stage as usize] / flops_per_sample[to as usize];
            t[to as usize] += p.throughput * scale;
            moves.push(Move {
                peer: p.peer,
                from: p.stage,
                to,
                before,
                after: slowest(&t),
            });
        }
    }
    let best = moves
        .iter()
        .map(|m| m.after)
        .fold(f64::NEG_INFINITY, f64::max);
    let good_enough = best - MOVE_TIE * (best - before);
    moves
        .into_iter()
        .filter(|m| m.after >= good_enough && m.after > before * (1.0 + gain))
        .min_by(|a, b| a.peer.cmp(&b.peer).then(b.after.total_cmp(&a.after)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::{SeededRng, fixtures};

    #[test]
    fn joiners_fill_empty_then_slow_stages() {
        let p = |peer, stage, throughput| fixtures::placement(peer, stage, throughput, 0);
        let needs = |n: [u64; 3]| {
            n.map(|resident| Need {
                resident,
                offloaded: resident / 4,
            })
        };
        let need = needs([10, 10, 30]);
        let choose = |placements: &[Placement], need: &[Need], memory| {
            choose_stage(placements, need, memory, false)
        };
        assert_eq!(choose(&[], &need, 0), Some(0));
        assert_eq!(choose(&[p(1, 0, 0.0)], &need, 0), Some(1));
        assert_eq!(
            choose(&[p(1, 0, 0.0), p(2, 1, 0.0), p(3, 2, 0.0)], &need, 0),
            Some(0)
        );
        let slow_middle = [p(1, 0, 10.0), p(2, 1, 4.0), p(3, 2, 8.0)];
        assert_eq!(choose(&slow_middle, &need, 0), Some(1));
        // Memory: a stage that does not fit is never taken, even if it is empty.
        assert_eq!(choose(&[p(1, 0, 0.0)], &need, 20), Some(1));
        assert_eq!(choose(&[p(1, 0, 0.0), p(2, 1, 0.0)], &need, 20), Some(0));
        assert_eq!(choose(&slow_middle, &needs([10, 40, 30]), 35), Some(2));
        assert_eq!(choose(&[], &need, 5), None);
        // ... unless the peer offloads and the stage's offloaded need fits.
        let two = [p(1, 0, 0.0), p(2, 1, 0.0)];
        assert_eq!(choose_stage(&two, &need, 20, true), Some(2));
        assert_eq!(choose_stage(&[], &need, 5, true), Some(0));
        assert_eq!(choose_stage(&[], &need, 1, true), None);
    }

    #[test]
    fn no_move_to_a_stage_that_does_not_fit() {
        let p = fixtures::placement;
        let flops = [1.0, 1.0];
        let need = [4, 8].map(|resident| Need {
            resident,
            offloaded: 3,
        });
        // Stage 1 is starved; peer 2 could fix it but cannot hold it, peer 1 can.
        let placements = [p(1, 0, 10.0, 0), p(2, 0, 10.0, 5), p(3, 1, 1.0, 0)];
        let m = plan_move(&placements, &flops, &need, 0.1).unwrap();
        assert_eq!((m.peer, m.to), (PeerKey(1), 1));
        let small = [p(1, 0, 10.0, 5), p(2, 0, 10.0, 5), p(3, 1, 1.0, 0)];
        assert_eq!(plan_move(&small, &flops, &need, 0.1), None);
        // Offloading, peer 2 holds it.
        let offloading = [
            p(1, 0, 10.0, 5),
            Placement {
                offloads: true,
                ..p(2, 0, 10.0, 5)
            },
            p(3, 1, 1.0, 0),
        ];
        let m = plan_move(&offloading, &flops, &need, 0.1).unwrap();
        assert_eq!((m.peer, m.to), (PeerKey(2), 1));
    }

    /// Peers with similar devices see slightly different throughputs (noise, gossip lag);
    /// they must still agree on who moves.
    #[test]
    fn peers_that_measure_slightly_differently_agree_on_the_mover() {
        let p = |peer, stage, throughput| fixtures::placement(peer, stage, throughput, 0);
        let flops = [1.0, 1.0];
        let mut rng = SeededRng::new(9);
        for _ in 0..100 {
            let view: Vec<Placement> = (0..8)
                .map(|i| {
                    let (stage, speed) = if i < 4 { (0, 2000.0) } else { (1, 190.0) };
                    p(10 + i, stage, speed * (0.94 + 0.12 * rng.next_f64()))
                })
                .collect();
            let m = plan_move(&view, &flops, &[Need::default(); 2], 0.25).unwrap();
            assert_eq!((m.peer, m.from, m.to), (PeerKey(10), 0, 1));
        }
        // A clearly better move still wins over a smaller key.
        let view = [
            p(1, 0, 500.0),
            p(2, 0, 2000.0),
            p(3, 0, 2000.0),
            p(4, 1, 100.0),
        ];
        assert_eq!(
            plan_move(&view, &flops, &[Need::default(); 2], 0.25)
                .unwrap()
                .peer,
            PeerKey(2)
        );
    }

    /// Applies planned moves until none is proposed: each move must raise the slowest stage
    /// by more than the hysteresis, no assignment may repeat (no oscillation), and it stops.
    #[test]
    fn rebalancing_converges_without_oscillation() {
        let flops = [1.0, 1.0, 2.0];
        let mut rng = SeededRng::new(3);
        for trial in 0..200 {
            let n = 3 + (rng.next_u64() % 10) as usize;
            // Per-peer speed in samples/s at a cost-1 stage.
            let speed: Vec<f64> = (0..n).map(|_| 1.0 + rng.next_f64() * 9.0).collect();
            let mut stage: Vec<u32> = (0..n).map(|i| (i % 3) as u32).collect();
            let placements = |stage: &[u32]| -> Vec<Placement> {
                (0..n)
                    .map(|i| Placement {
                        peer: PeerKey(i as u64),
                        stage: stage[i],
                        throughput: speed[i] / flops[stage[i] as usize],
                        memory: 0,
                        offloads: false,
                    })
                    .collect()
            };
            let mut seen = vec![stage.clone()];
            while let Some(m) = plan_move(&placements(&stage), &flops, &[Need::default(); 3], 0.1) {
                assert!(m.after > m.before * 1.1, "trial {trial}: a move must help");
                stage[m.peer.0 as usize] = m.to;
                assert!(!seen.contains(&stage), "trial {trial}: assignment repeated");
                seen.push(stage.clone());
                assert!(seen.len() <= 3 * n, "trial {trial}: does not converge");
            }
            let totals = stage_totals(&placements(&stage), 3);
            assert!(totals.iter().all(|t| t.1 > 0), "no stage is emptied");
        }
    }
}
