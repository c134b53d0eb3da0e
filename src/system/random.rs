//! Random numbers from the kernel (`getrandom`), for nonces and names no other process can
//! guess.
//!
//! Invariant: a number is returned only once all of its bytes came from the kernel; an
//! interrupted call is retried, any other failure is an error, never a weaker number.

use crate::error::{Error, Result};

/// A random `u64` from the kernel.
pub fn random_u64() -> Result<u64> {
    let mut out = [0u8; 8];
    let mut filled = 0;
    while filled < out.len() {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::os("getrandom", e)),
        }
    }
    Ok(u64::from_le_bytes(out))
}
