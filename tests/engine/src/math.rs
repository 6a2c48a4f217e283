//! The few kernels the model needs, in a fixed evaluation order (bit-reproducible).

use dejavu_proto::rng::SplitMix64;

/// `out[j] = sum_i x[i] * w[i * cols + j]` for a row-major `w` of `x.len()` rows and `cols` columns.
pub fn matvec(x: &[f32], w: &[f32], cols: usize, out: &mut [f32]) {
    debug_assert_eq!(w.len(), x.len() * cols);
    out[..cols].fill(0.0);
    for (i, &xi) in x.iter().enumerate() {
        let row = &w[i * cols..(i + 1) * cols];
        for (o, &wij) in out[..cols].iter_mut().zip(row) {
            *o += xi * wij;
        }
    }
}

/// RMSNorm with gain `g`, in place.
pub fn rms_norm(x: &mut [f32], g: &[f32]) {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean + 1e-5).sqrt();
    for (v, gi) in x.iter_mut().zip(g) {
        *v *= scale * gi;
    }
}

/// Rotary position embedding of one head vector at `position`, in place.
pub fn rope(v: &mut [f32], position: u32) {
    let half = v.len() / 2;
    for i in 0..half {
        let freq = 1.0 / 10000f32.powf(i as f32 / half as f32);
        let (sin, cos) = (position as f32 * freq).sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * cos - b * sin;
        v[i + half] = a * sin + b * cos;
    }
}

/// Softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Index of the largest value (the first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// The weights' generator: the project's SplitMix64, drawing floats.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// Uniform in `[-scale, scale)`.
    pub fn uniform(&mut self, scale: f32) -> f32 {
        let unit = (self.0.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (unit * 2.0 - 1.0) * scale
    }

    /// `n` values uniform in `[-scale, scale)`.
    pub fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(scale)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_do_what_they_say() {
        let mut out = [0.0; 2];
        matvec(&[1.0, 2.0], &[1.0, 2.0, 3.0, 4.0], 2, &mut out);
        assert_eq!(out, [7.0, 10.0]);
        let mut p = [1.0, 2.0, 3.0];
        softmax(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6 && p[2] > p[1] && p[1] > p[0]);
        assert_eq!(argmax(&[0.5, 2.0, 2.0, -1.0]), 1);
        let mut v = [1.0, 0.0, 0.0, 1.0];
        rope(&mut v, 0);
        assert_eq!(v, [1.0, 0.0, 0.0, 1.0], "position 0 is the identity");
        let (mut a, mut b) = (Rng::new(3), Rng::new(3));
        assert_eq!(a.fill(5, 1.0), b.fill(5, 1.0));
    }
}
