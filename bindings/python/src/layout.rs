//! Specs, layouts and regions.

use std::ops::Range;

use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
use dejavulib::{DType, KvLayout, KvRegion, KvSpec};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyRange, PyRangeMethods};

use crate::errors::*;

pub(crate) fn dtype(name: &str) -> PyResult<DType> {
    Ok(match name {
        "float32" | "f32" => DType::F32,
        "float16" | "f16" => DType::F16,
        "bfloat16" | "bf16" => DType::BF16,
        "float8_e4m3" | "float8_e4m3fn" | "fp8" => DType::Fp8E4M3,
        "int8" | "i8" => DType::Int8,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown dtype {other:?}: use float32, float16, bfloat16, float8_e4m3 or int8"
            )))
        }
    })
}

/// A `range` (step 1), a `(start, stop)` pair or a single index.
pub(crate) fn range_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Range<u32>> {
    if let Ok(r) = obj.cast::<PyRange>() {
        if r.step()? != 1 {
            return Err(PyValueError::new_err(format!("{what}: only ranges with step 1")));
        }
        let (start, stop) = (r.start()?, r.stop()?);
        return to_range(start, stop.max(start), what);
    }
    if let Ok((start, stop)) = obj.extract::<(i64, i64)>() {
        return to_range(start as isize, stop as isize, what);
    }
    if let Ok(i) = obj.extract::<i64>() {
        return to_range(i as isize, i as isize + 1, what);
    }
    Err(PyTypeError::new_err(format!("{what} must be a range, a (start, stop) pair or an int")))
}

pub(crate) fn to_range(start: isize, stop: isize, what: &str) -> PyResult<Range<u32>> {
    let ok = |v: isize| {
        u32::try_from(v).map_err(|_| PyValueError::new_err(format!("{what}: {v} is out of range")))
    };
    let (start, stop) = (ok(start)?, ok(stop)?);
    if stop < start {
        return Err(PyValueError::new_err(format!("{what}: stop {stop} is before start {start}")));
    }
    Ok(start..stop)
}

pub(crate) fn py_range(r: &Range<u32>) -> (u32, u32) {
    (r.start, r.end)
}

/// The shape of a model's KV cache: layers, KV heads, head size and element type.
#[pyclass(name = "KvSpec", module = "dejavu", frozen)]
#[derive(Clone)]
pub(crate) struct PySpec(pub(crate) KvSpec);

#[pymethods]
impl PySpec {
    #[new]
    #[pyo3(signature = (layers, kv_heads, head_dim, dtype = "float16"))]
    fn new(layers: u32, kv_heads: u32, head_dim: u32, dtype: &str) -> PyResult<Self> {
        Ok(Self(KvSpec::new(layers, kv_heads, head_dim, self::dtype(dtype)?).map_err(value_err)?))
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.0.layers()
    }

    #[getter]
    fn kv_heads(&self) -> u32 {
        self.0.kv_heads()
    }

    #[getter]
    fn head_dim(&self) -> u32 {
        self.0.head_dim()
    }

    /// Bytes of K and V one token takes across all layers and heads.
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.0.bytes_per_token()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// Where every KV element of a cache lives.
#[pyclass(name = "KvLayout", module = "dejavu", frozen)]
pub(crate) struct PyLayout(pub(crate) KvLayout);

#[pymethods]
impl PyLayout {
    /// FasterTransformer: K `[L][B][H][D/x][S][x]` (x = 16 bytes of elements), V `[L][B][H][S][D]`.
    #[staticmethod]
    fn faster_transformer(spec: &PySpec, slots: u32, max_tokens: u32) -> PyResult<Self> {
        Ok(Self(KvLayout::faster_transformer(spec.0, slots, max_tokens).map_err(value_err)?))
    }

    /// One K and one V tensor per layer, `[B][H][S][D]` ("bhsd", HF) or `[B][S][H][D]` ("bshd").
    #[staticmethod]
    #[pyo3(signature = (spec, slots, max_tokens, order = "bhsd"))]
    fn per_layer(spec: &PySpec, slots: u32, max_tokens: u32, order: &str) -> PyResult<Self> {
        let order = match order {
            "bhsd" => PerLayerOrder::Bhsd,
            "bshd" => PerLayerOrder::Bshd,
            other => return Err(PyValueError::new_err(format!("order {other:?}: use \"bhsd\" or \"bshd\""))),
        };
        Ok(Self(KvLayout::per_layer(spec.0, slots, max_tokens, order).map_err(value_err)?))
    }

    /// vLLM-style paged blocks per layer, NHD or HND, K and V separate (`interleaved=False`),
    /// interleaved per block (`True` or "block": `[num_blocks][2][block]`) or per head ("head":
    /// vLLM's CPU backend, HND only: per block and head, K as `[D / k_chunk][block_size][k_chunk]`
    /// (rows by default), then V as `[block_size][D]`) or per token ("token": vLLM's unified
    /// cache on its GPU backends, each token's K vector of a head then its V vector, per block
    /// `[block_size][H][2][D]` in NHD or `[H][block_size][2][D]` in HND);
    /// `block_tables[slot]` lists the physical blocks of each sequence.
    #[staticmethod]
    #[pyo3(signature = (spec, slots, block_size, num_blocks, order = "nhd", interleaved = None, block_tables = None, k_chunk = None))]
    // Python's keyword arguments, one per geometry choice.
    #[allow(clippy::too_many_arguments)]
    fn paged(
        spec: &PySpec,
        slots: u32,
        block_size: u32,
        num_blocks: u32,
        order: &str,
        interleaved: Option<&Bound<'_, PyAny>>,
        block_tables: Option<Vec<Vec<u32>>>,
        k_chunk: Option<u32>,
    ) -> PyResult<Self> {
        let order = match order {
            "nhd" => PagedOrder::Nhd,
            "hnd" => PagedOrder::Hnd,
            other => return Err(PyValueError::new_err(format!("order {other:?}: use \"nhd\" or \"hnd\""))),
        };
        let interleave = match interleaved {
            None => KvInterleave::Separate,
            Some(how) => match (how.extract::<bool>(), how.extract::<String>().as_deref()) {
                (Ok(false), _) => KvInterleave::Separate,
                (Ok(true), _) | (_, Ok("block")) => KvInterleave::Interleaved,
                (_, Ok("head")) => KvInterleave::PerHead { k_chunk: k_chunk.unwrap_or(spec.0.head_dim()) },
                (_, Ok("token")) => KvInterleave::PerToken,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "interleaved {how}: use False, True (\"block\"), \"head\" or \"token\""
                    )))
                }
            },
        };
        let config = PagedConfig { block_size, num_blocks, order, interleave };
        let tables = block_tables.map(BlockTables::from_tables);
        Ok(Self(KvLayout::paged(spec.0, slots, config, tables).map_err(value_err)?))
    }

    /// Bytes of each buffer a cache of this layout has.
    #[getter]
    fn buffer_sizes(&self) -> Vec<u64> {
        self.0.buffer_sizes().to_vec()
    }

    #[getter]
    fn spec(&self) -> PySpec {
        PySpec(*self.0.spec())
    }

    #[getter]
    fn slots(&self) -> u32 {
        self.0.slots()
    }

    #[getter]
    fn max_tokens(&self) -> u32 {
        self.0.max_tokens()
    }

    fn __repr__(&self) -> String {
        format!("KvLayout({:?}, buffers={:?})", self.0.kind(), self.0.buffer_sizes())
    }
}

/// Layers x slots x heads x tokens of a cache.
#[pyclass(name = "KvRegion", module = "dejavu", frozen)]
pub(crate) struct PyRegion(pub(crate) KvRegion);

#[pymethods]
impl PyRegion {
    #[new]
    fn new(
        layers: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        heads: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(Self(KvRegion::new(
            range_arg(layers, "layers")?,
            range_arg(slots, "slots")?,
            range_arg(heads, "heads")?,
            range_arg(tokens, "tokens")?,
        )))
    }

    #[getter]
    fn layers(&self) -> (u32, u32) {
        py_range(&self.0.layers)
    }

    #[getter]
    fn slots(&self) -> (u32, u32) {
        py_range(&self.0.slots)
    }

    #[getter]
    fn heads(&self) -> (u32, u32) {
        py_range(&self.0.heads)
    }

    #[getter]
    fn tokens(&self) -> (u32, u32) {
        py_range(&self.0.tokens)
    }

    fn __repr__(&self) -> String {
        let r = &self.0;
        format!(
            "KvRegion(layers={:?}, slots={:?}, heads={:?}, tokens={:?})",
            r.layers, r.slots, r.heads, r.tokens
        )
    }
}
