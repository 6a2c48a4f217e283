//! What a KV cache holds: element types, per-model shape and the parts of a cache.

use thiserror::Error;

/// Element type of the K and V tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit float, 4 exponent and 3 mantissa bits (quantized KV).
    Fp8E4M3,
    /// Signed 8-bit integer (quantized KV).
    Int8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Fp8E4M3 | DType::Int8 => 1,
        }
    }

    /// Whether values of this type are usually stored with a scale.
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::Fp8E4M3 | DType::Int8)
    }

    /// Stable one-byte code used in chunk headers.
    pub const fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::Fp8E4M3 => 3,
            DType::Int8 => 4,
        }
    }

    /// Inverse of [`DType::code`].
    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            3 => DType::Fp8E4M3,
            4 => DType::Int8,
            _ => return None,
        })
    }
}

/// How quantization scales are stored beside quantized K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleMode {
    /// No scale array (unquantized KV, or a per-tensor scale the engine keeps itself).
    None,
    /// One `f32` scale per (layer, K|V, slot, head, token): it travels with the KV it scales.
    PerTokenHead,
}

/// Size in bytes of one scale value.
pub const SCALE_BYTES: usize = 4;

/// One of the tensors a KV cache is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// Keys.
    K,
    /// Values.
    V,
    /// Scales of the keys (quantized KV only).
    KScale,
    /// Scales of the values (quantized KV only).
    VScale,
}

impl Part {
    /// All parts, in the order they appear in packed buffers.
    pub const ALL: [Part; 4] = [Part::K, Part::V, Part::KScale, Part::VScale];

    /// Dense index, `0..4`.
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Whether this part is a scale array.
    pub const fn is_scale(self) -> bool {
        matches!(self, Part::KScale | Part::VScale)
    }
}

/// Errors in a [`KvSpec`].
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    /// A dimension was zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A scale array was requested for an unquantized element type.
    #[error("scales are only meaningful for int8/fp8 KV, not {0:?}")]
    ScalesWithoutQuantization(DType),
}

/// Shape of a KV cache as the model defines it: layers, KV heads, head size and element type.
///
/// A worker's local cache uses a `KvSpec` of its own share (its layers and heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvSpec {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: DType,
    scales: ScaleMode,
}

impl KvSpec {
    /// A spec without scales.
    pub fn new(layers: u32, kv_heads: u32, head_dim: u32, dtype: DType) -> Result<Self, SpecError> {
        Self::with_scales(layers, kv_heads, head_dim, dtype, ScaleMode::None)
    }

    /// A spec whose quantized KV carries a scale array.
    pub fn with_scales(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: DType,
        scales: ScaleMode,
    ) -> Result<Self, SpecError> {
        for (name, value) in [("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)] {
            if value == 0 {
                return Err(SpecError::Zero(name));
            }
        }
        if scales != ScaleMode::None && !dtype.is_quantized() {
            return Err(SpecError::ScalesWithoutQuantization(dtype));
        }
        Ok(Self { layers, kv_heads, head_dim, dtype, scales })
    }

    /// Number of transformer layers.
    pub fn layers(&self) -> u32 {
        self.layers
    }

    /// Number of KV heads (fewer than query heads under GQA/MQA).
    pub fn kv_heads(&self) -> u32 {
        self.kv_heads
    }

    /// Elements per head vector.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }

    /// Element type of K and V.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Scale storage.
    pub fn scales(&self) -> ScaleMode {
        self.scales
    }

    /// The same model restricted to `layers` layers and `kv_heads` heads (a worker's share).
    pub fn share(&self, layers: u32, kv_heads: u32) -> Result<Self, SpecError> {
        Self::with_scales(layers, kv_heads, self.head_dim, self.dtype, self.scales)
    }

    /// Parts present in this cache: K and V, plus their scales when quantized with scales.
    pub fn parts(&self) -> &'static [Part] {
        match self.scales {
            ScaleMode::None => &Part::ALL[..2],
            ScaleMode::PerTokenHead => &Part::ALL,
        }
    }

    /// Elements in one (token, head) vector of `part`.
    pub fn vector_elems(&self, part: Part) -> u32 {
        if part.is_scale() {
            1
        } else {
            self.head_dim
        }
    }

    /// Bytes of one element of `part`.
    pub fn elem_bytes(&self, part: Part) -> usize {
        if part.is_scale() {
            SCALE_BYTES
        } else {
            self.dtype.size()
        }
    }

    /// Bytes of one (token, head) vector of `part`.
    pub fn vector_bytes(&self, part: Part) -> u64 {
        self.vector_elems(part) as u64 * self.elem_bytes(part) as u64
    }

    /// KV bytes of one token of one sequence, all layers and heads, scales included.
    ///
    /// Without scales this is `2 * bytes_per_elem * kv_heads * head_dim * layers`.
    pub fn bytes_per_token(&self) -> u64 {
        let per_head: u64 = self.parts().iter().map(|&p| self.vector_bytes(p)).sum();
        // Saturate rather than wrap for absurd specs (every caller compares against real sizes).
        per_head.saturating_mul(self.kv_heads as u64).saturating_mul(self.layers as u64)
    }

    /// Whether two specs describe the same elements, ignoring how many layers and heads each holds.
    pub fn same_elements(&self, other: &KvSpec) -> bool {
        self.head_dim == other.head_dim && self.dtype == other.dtype && self.scales == other.scales
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama2_13b_bf16_is_819200_bytes_per_token() {
        let spec = KvSpec::new(40, 40, 128, DType::BF16).unwrap();
        assert_eq!(spec.bytes_per_token(), 819_200);
    }

    #[test]
    fn llama2_70b_gqa_is_327680_bytes_per_token() {
        let spec = KvSpec::new(80, 8, 128, DType::F16).unwrap();
        assert_eq!(spec.bytes_per_token(), 327_680);
    }

    #[test]
    fn scales_add_four_bytes_per_head_and_part() {
        let spec = KvSpec::with_scales(2, 4, 64, DType::Int8, ScaleMode::PerTokenHead).unwrap();
        assert_eq!(spec.bytes_per_token(), 2 * 4 * (64 + 64 + 4 + 4));
        assert_eq!(spec.parts().len(), 4);
    }

    #[test]
    fn invalid_specs_are_typed_errors() {
        assert_eq!(KvSpec::new(0, 1, 1, DType::F16), Err(SpecError::Zero("layers")));
        assert_eq!(
            KvSpec::with_scales(1, 1, 1, DType::F16, ScaleMode::PerTokenHead),
            Err(SpecError::ScalesWithoutQuantization(DType::F16))
        );
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in [DType::F32, DType::F16, DType::BF16, DType::Fp8E4M3, DType::Int8] {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_code(99), None);
    }
}
