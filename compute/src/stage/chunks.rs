//! Where a stage's transformer blocks keep their parameters and gradients: on the device, or,
//! under a memory limit, on the host with the device as a cache of whole blocks.
//!
//! The unit moved is one block (its twelve tensors): a pipeline stage uses its blocks in a
//! fixed order, forward then backward, so a block is the natural chunk (PatrickStar groups
//! tensors into chunks of the order they are used in, for the same reason). Under a limit the
//! host copy of a block's parameters is the authority and the device copy is only read, so
//! evicting parameters costs nothing; gradients accumulate on the device while the block is
//! there and are copied back when it leaves. The least recently used block leaves first,
//! which suits the sweep: a forward pass ends on the blocks its backward pass starts with.
//! Copies are exact, so a stage computes the same numbers however little of it fits.

use super::{Block, TensorInfo};
use crate::backend::{Backend, BackendError, kernels};
use std::ops::Range;

/// One block's tensors on the device.
struct OnDevice<B: Backend> {
    params: Block<B::Buffer>,
    /// Present while a backward pass needs them; then they are the authority.
    grads: Option<Block<B::Buffer>>,
}

/// One block's tensors on the host, each tensor's values in [`Block::iter`] order.
struct OnHost {
    params: Vec<f32>,
    grads: Vec<f32>,
    /// The gradients are all zero: a fetch allocates them instead of copying.
    grads_zero: bool,
}

struct Chunk<B: Backend> {
    /// Each tensor's length, in [`Block::iter`] order.
    lens: [usize; 12],
    device: Option<OnDevice<B>>,
    /// None where the block never leaves the device (no limit).
    host: Option<OnHost>,
    last_use: u64,
}

impl<B: Backend> Chunk<B> {
    fn values(&self) -> usize {
        self.lens.iter().sum()
    }

    fn device_bytes(&self) -> u64 {
        let per = 4 * self.values() as u64;
        match &self.device {
            None => 0,
            Some(d) => per * (1 + d.grads.is_some() as u64),
        }
    }
}

/// Bytes moved between host and device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadTraffic {
    /// Host to device.
    pub uploaded: u64,
    /// Device to host.
    pub downloaded: u64,
}

/// Parameters or their gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Params,
    Grads,
}

/// The blocks of one stage (see the module docs).
pub(super) struct Chunks<B: Backend> {
    chunks: Vec<Chunk<B>>,
    clock: u64,
    traffic: OffloadTraffic,
}

/// Why a block could not be brought to the device.
pub(super) enum FetchError {
    Backend(BackendError),
    /// It does not fit the budget beside the blocks that must stay: they would hold `needed`.
    NoRoom {
        needed: u64,
    },
}

impl From<BackendError> for FetchError {
    fn from(e: BackendError) -> Self {
        FetchError::Backend(e)
    }
}

fn lens(info: &Block<TensorInfo>) -> [usize; 12] {
    info.iter().map(|i| i.len)
}

/// Where each tensor lies within a block's flat host copy.
fn ranges(lens: &[usize; 12]) -> [Range<usize>; 12] {
    let mut at = 0;
    lens.map(|len| {
        at += len;
        at - len..at
    })
}

/// A block's tensors on the device, from `values` (concatenated).
fn upload<B: Backend>(
    b: &B,
    lens: &[usize; 12],
    values: &[f32],
) -> Result<Block<B::Buffer>, BackendError> {
    let r = ranges(lens);
    Block::try_build(|j| b.upload(&values[r[j].clone()]))
}

/// Copies a block's tensors on the device into `out` (concatenated).
fn download<B: Backend>(
    b: &B,
    t: &Block<B::Buffer>,
    lens: &[usize; 12],
    out: &mut [f32],
) -> Result<(), BackendError> {
    for (buf, r) in t.iter().into_iter().zip(ranges(lens)) {
        b.download(buf, &mut out[r])?;
    }
    Ok(())
}

/// Overwrites a block's tensors on the device with `values` (concatenated).
fn write<B: Backend>(
    b: &B,
    t: &mut Block<B::Buffer>,
    lens: &[usize; 12],
    values: &[f32],
) -> Result<(), BackendError> {
    for (buf, r) in t.iter_mut().into_iter().zip(ranges(lens)) {
        b.write(buf, &values[r])?;
    }
    Ok(())
}

impl<B: Backend> Chunks<B> {
    /// Blocks that live on the device for good, holding `values` (each block's tensors in
    /// [`Block::iter`] order, concatenated).
    pub(super) fn resident(
        b: &B,
        info: &[Block<TensorInfo>],
        values: impl Iterator<Item = Vec<f32>>,
    ) -> Result<Self, BackendError> {
        let chunks = info
            .iter()
            .zip(values)
            .map(|(info, v)| {
                let lens = lens(info);
                let params = upload(b, &lens, &v)?;
                Ok(Chunk {
                    lens,
                    device: Some(OnDevice {
                        params,
                        grads: Some(info.try_map(|i| b.alloc(i.len))?),
                    }),
                    host: None,
                    last_use: 0,
                })
            })
            .collect::<Result<_, BackendError>>()?;
        Ok(Chunks {
            chunks,
            clock: 0,
            traffic: OffloadTraffic::default(),
        })
    }

    /// Blocks held on the host, brought to the device while used.
    pub(super) fn offloaded(
        info: &[Block<TensorInfo>],
        values: impl Iterator<Item = Vec<f32>>,
    ) -> Self {
        let chunks = info
            .iter()
            .zip(values)
            .map(|(info, params)| Chunk {
                lens: lens(info),
                device: None,
                host: Some(OnHost {
                    grads: vec![0.0; params.len()],
                    params,
                    grads_zero: true,
                }),
                last_use: 0,
            })
            .collect();
        Chunks {
            chunks,
            clock: 0,
            traffic: OffloadTraffic::default(),
        }
    }

    /// Device bytes of parameters and of gradients the blocks hold now.
    pub(super) fn device_bytes(&self) -> (u64, u64) {
        self.chunks.iter().fold((0, 0), |(p, g), c| {
            let per = 4 * c.values() as u64;
            match &c.device {
                None => (p, g),
                Some(d) => (p + per, g + if d.grads.is_some() { per } else { 0 }),
            }
        })
    }

    /// Bytes moved between host and device so far.
    pub(super) fn traffic(&self) -> OffloadTraffic {
        self.traffic
    }

    /// The most device memory one block can need (parameters and gradients).
    pub(super) fn largest_block_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| 8 * c.values() as u64)
            .max()
            .unwrap_or(0)
    }

    /// Brings block `i` to the device (its gradients too if `grads`), evicting the least
    /// recently used others (never `keep`) until the blocks hold at most `budget` bytes.
    pub(super) fn fetch(
        &mut self,
        b: &B,
        i: usize,
        grads: bool,
        budget: u64,
        keep: Option<usize>,
    ) -> Result<(), FetchError> {
        self.clock += 1;
        let clock = self.clock;
        let c = &mut self.chunks[i];
        c.last_use = clock;
        let per = 4 * c.values() as u64;
        let needed = match &c.device {
            None => per * (1 + grads as u64),
            Some(d) => per * (grads && d.grads.is_none()) as u64,
        };
        if needed == 0 {
            return Ok(());
        }
        let kept: u64 = [Some(i), keep]
            .into_iter()
            .flatten()
            .map(|j| self.chunks[j].device_bytes())
            .sum();
        if kept + needed > budget {
            // Evicting the others would not make room: keep them.
            return Err(FetchError::NoRoom {
                needed: kept + needed,
            });
        }
        let held: u64 = self.chunks.iter().map(|c| c.device_bytes()).sum();
        if held + needed > budget {
            self.evict_to(b, budget - needed, [Some(i), keep])?;
        }
        let held: u64 = self.chunks.iter().map(|c| c.device_bytes()).sum();
        if held + needed > budget {
            return Err(FetchError::NoRoom {
                needed: held + needed,
            });
        }
        let c = &mut self.chunks[i];
        let Some(host) = c.host.as_mut() else {
            unreachable!("a block that is not on the device has a host copy");
        };
        if c.device.is_none() {
            let params = upload(b, &c.lens, &host.params)?;
            self.traffic.uploaded += per;
            c.device = Some(OnDevice {
                params,
                grads: None,
            });
        }
        if grads {
            let g = if host.grads_zero {
                Block::try_build(|j| b.alloc(c.lens[j]))?
            } else {
                self.traffic.uploaded += per;
                upload(b, &c.lens, &host.grads)?
            };
            if let Some(d) = c.device.as_mut() {
                d.grads = Some(g);
            }
        }
        Ok(())
    }

    /// [`Chunks::fetch`] where there is room (without evicting `keep`), else nothing: the
    /// block is fetched when it is needed instead.
    pub(super) fn prefetch(
        &mut self,
        b: &B,
        i: usize,
        grads: bool,
        budget: u64,
        keep: Option<usize>,
    ) -> Result<(), BackendError> {
        match self.fetch(b, i, grads, budget, keep) {
            Ok(()) | Err(FetchError::NoRoom { .. }) => Ok(()),
            Err(FetchError::Backend(e)) => Err(e),
        }
    }

    /// Evicts least recently used blocks (never those in `keep`) until the blocks hold at
    /// most `budget` bytes of device memory, or only kept blocks are left.
    pub(super) fn evict_to(
        &mut self,
        b: &B,
        budget: u64,
        keep: [Option<usize>; 2],
    ) -> Result<(), BackendError> {
        loop {
            let held: u64 = self.chunks.iter().map(|c| c.device_bytes()).sum();
            if held <= budget {
                return Ok(());
            }
            let victim = self
                .chunks
                .iter()
                .enumerate()
                .filter(|(j, c)| {
                    c.device.is_some() && c.host.is_some() && !keep.contains(&Some(*j))
                })
                .min_by_key(|(_, c)| c.last_use)
                .map(|(j, _)| j);
            let Some(j) = victim else {
                return Ok(());
            };
            self.evict(b, j)?;
        }
    }

    fn evict(&mut self, b: &B, j: usize) -> Result<(), BackendError> {
        let c = &mut self.chunks[j];
        // Only a block with a host copy leaves the device.
        let Some(host) = c.host.as_mut() else {
            return Ok(());
        };
        let Some(d) = c.device.take() else {
            return Ok(());
        };
        if let Some(g) = d.grads {
            download(b, &g, &c.lens, &mut host.grads)?;
            host.grads_zero = false;
            self.traffic.downloaded += 4 * c.values() as u64;
        }
        Ok(())
    }

    /// Block `i`'s parameters and gradients on the device (fetched before).
    pub(super) fn on_device(&mut self, i: usize) -> (&mut Block<B::Buffer>, &mut Block<B::Buffer>) {
        let Some(OnDevice {
            params,
            grads: Some(grads),
        }) = self.chunks[i].device.as_mut()
        else {
            unreachable!("block {i} was fetched with its gradients");
        };
        (params, grads)
    }

    /// Block `i`'s parameters on the device (fetched before).
    pub(super) fn params_on_device(&self, i: usize) -> &Block<B::Buffer> {
        match self.chunks[i].device.as_ref() {
            Some(d) => &d.params,
            None => unreachable!("block {i} was fetched"),
        }
    }

    /// Copies block `i`'s parameters or gradients into `out` (its tensors concatenated).
    pub(super) fn read(
        &self,
        b: &B,
        i: usize,
        kind: Kind,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let c = &self.chunks[i];
        let on_device = match (&c.device, kind) {
            (Some(d), Kind::Params) if c.host.is_none() => Some(&d.params),
            (Some(d), Kind::Grads) => d.grads.as_ref(),
            _ => None,
        };
        match (on_device, &c.host) {
            (Some(t), _) => download(b, t, &c.lens, out)?,
            (None, Some(h)) => out.copy_from_slice(match kind {
                Kind::Params => &h.params,
                Kind::Grads => &h.grads,
            }),
            (None, None) => unreachable!("a block is on the device or on the host"),
        }
        Ok(())
    }

    /// Overwrites block `i`'s parameters or gradients with `values`.
    pub(super) fn write(
        &mut self,
        b: &B,
        i: usize,
        kind: Kind,
        values: &[f32],
    ) -> Result<(), BackendError> {
        let c = &mut self.chunks[i];
        if let Some(h) = c.host.as_mut() {
            match kind {
                Kind::Params => h.params.copy_from_slice(values),
                Kind::Grads => {
                    h.grads.copy_from_slice(values);
                    h.grads_zero = false;
                }
            }
        }
        let on_device = match (c.device.as_mut(), kind) {
            (Some(d), Kind::Params) => Some(&mut d.params),
            (Some(d), Kind::Grads) => d.grads.as_mut(),
            (None, _) => None,
        };
        if let Some(t) = on_device {
            write(b, t, &c.lens, values)?;
        }
        Ok(())
    }

    /// Sets every gradient to zero.
    pub(super) fn zero_grads(&mut self, b: &B) -> Result<(), BackendError> {
        for c in &mut self.chunks {
            if let Some(h) = c.host.as_mut() {
                // Offloaded gradients leave the device: a fetch allocates them zeroed.
                h.grads.fill(0.0);
                h.grads_zero = true;
                if let Some(d) = c.device.as_mut() {
                    d.grads = None;
                }
            } else if let Some(g) = c.device.as_mut().and_then(|d| d.grads.as_mut()) {
                for buf in g.iter_mut() {
                    b.fill(buf, 0.0)?;
                }
            }
        }
        Ok(())
    }

    /// Sum of squared gradients of each tensor of block `i`, in order: on the device where
    /// they are there, else on the host, reduced as the CPU backend reduces.
    pub(super) fn grad_sum_squares(&self, b: &B, i: usize) -> Result<[f64; 12], BackendError> {
        let c = &self.chunks[i];
        let mut out = [0.0; 12];
        match (c.device.as_ref().and_then(|d| d.grads.as_ref()), &c.host) {
            (Some(g), _) => {
                for (o, buf) in out.iter_mut().zip(g.iter()) {
                    *o = b.sum_squares(buf)?;
                }
            }
            (None, Some(h)) => {
                for (o, r) in out.iter_mut().zip(ranges(&c.lens)) {
                    *o = kernels::sum_squares_chunked(&h.grads[r]);
                }
            }
            (None, None) => unreachable!("gradients are on the device or on the host"),
        }
        Ok(out)
    }

    /// Runs `step` on each tensor of offloaded block `i` with its host parameters and
    /// gradients (the gradients copied back first where the device holds them), then
    /// refreshes the device's copy of the parameters.
    pub(super) fn step_on_host(
        &mut self,
        b: &B,
        i: usize,
        mut step: impl FnMut(usize, Range<usize>, &mut [f32], &[f32]),
    ) -> Result<(), BackendError> {
        let c = &mut self.chunks[i];
        let bytes = 4 * c.values() as u64;
        let Some(h) = c.host.as_mut() else {
            unreachable!("only offloaded blocks step on the host");
        };
        if let Some(g) = c.device.as_ref().and_then(|d| d.grads.as_ref()) {
            download(b, g, &c.lens, &mut h.grads)?;
            h.grads_zero = false;
            self.traffic.downloaded += bytes;
        }
        for (j, r) in ranges(&c.lens).into_iter().enumerate() {
            step(j, r.clone(), &mut h.params[r.clone()], &h.grads[r]);
        }
        if let Some(d) = c.device.as_mut() {
            write(b, &mut d.params, &c.lens, &h.params)?;
            self.traffic.uploaded += bytes;
        }
        Ok(())
    }
}
