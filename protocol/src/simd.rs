//! Run-time choice between a baseline and an AVX2+FMA build of a hot loop.
//!
//! The codecs must keep up with the network on every machine the binary runs on, so their
//! inner loops are written for auto-vectorisation and compiled twice; the binary stays
//! portable. (The compute crate has its own copy: this crate depends on nothing of ours.)

/// Defines `pub fn $name(args)` that runs an AVX2+FMA build of `$body` where the CPU has it.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { generic($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports the features `avx2` was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

pub(crate) use multiversion;
