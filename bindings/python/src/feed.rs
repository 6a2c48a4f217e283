//! `RecoveryFeed`: whoever feeds a pipeline learns of the controller's recoveries and where each
//! sequence resumes ([`dejavulib::net::controller::RecoveryFeed`]).

use std::time::Duration;

use dejavu_proto::plan::{Loss, Source};
use dejavulib::message::{Mark, RecoveryOrders};
use dejavulib::net::auth::DEFAULT_SECRET;
use dejavulib::net::controller::{parse_controllers, QueryError, RecoveryFeed};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{value_err, ControllerError};
use crate::layout::py_range;

/// A controller's recovery feed (see `dejavu/_dejavu.pyi`).
#[pyclass(name = "RecoveryFeed", module = "dejavu")]
pub(crate) struct PyRecoveryFeed {
    feed: Mutex<RecoveryFeed>,
}

fn controller_err(e: QueryError) -> PyErr {
    ControllerError::new_err(e.to_string())
}

/// `marks` as a dict from (microbatch, (first slot, end slot)) to the first token to feed again.
fn marks_dict<'py>(py: Python<'py>, marks: &[Mark]) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for mark in marks {
        out.set_item((mark.microbatch, py_range(&mark.slots)), mark.tokens)?;
    }
    Ok(out)
}

fn orders_dict<'py>(py: Python<'py>, orders: &RecoveryOrders) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("epoch", orders.epoch)?;
    out.set_item("resume", marks_dict(py, &orders.resume_from())?)?;
    let mut stages = Vec::new();
    for stage in &orders.stages {
        let entry = PyDict::new(py);
        entry.set_item("stage", stage.plan.stage)?;
        let loss = match stage.plan.loss {
            Loss::Engine => "engine",
            Loss::Worker => "worker",
        };
        entry.set_item("loss", loss)?;
        let (source, holder) = match stage.plan.source {
            Source::Own => ("own", Some(stage.plan.stage)),
            Source::Successor(holder) => ("successor", Some(holder)),
            Source::Lost => ("lost", None),
        };
        entry.set_item("source", source)?;
        entry.set_item("restored_from", holder)?;
        entry.set_item("marks", marks_dict(py, &stage.marks)?)?;
        stages.push(entry);
    }
    out.set_item("stages", stages)?;
    Ok(out)
}

#[pymethods]
impl PyRecoveryFeed {
    #[new]
    #[pyo3(signature = (controller, secret = None))]
    fn new(controller: &str, secret: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let controllers = parse_controllers(controller).map_err(value_err)?;
        let secret: Vec<u8> = match secret {
            None => DEFAULT_SECRET.as_bytes().to_vec(),
            Some(s) => match s.extract::<String>() {
                Ok(text) => text.into_bytes(),
                Err(_) => s.extract::<Vec<u8>>()?,
            },
        };
        let feed = RecoveryFeed::following(&controllers, secret).expect("parsed at least one controller");
        Ok(Self { feed: Mutex::new(feed) })
    }

    #[pyo3(signature = (after = 0, timeout = 5.0))]
    fn watch<'py>(&self, py: Python<'py>, after: u64, timeout: f64) -> PyResult<Option<Bound<'py, PyDict>>> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(value_err(format!("timeout {timeout}: give seconds, 0 or more")));
        }
        let wait = Duration::from_secs_f64(timeout);
        let orders = py.detach(|| self.feed.lock().watch(after, wait)).map_err(controller_err)?;
        orders.map(|orders| orders_dict(py, &orders)).transpose()
    }

    fn acknowledge(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        py.detach(|| self.feed.lock().acknowledge(epoch)).map_err(controller_err)
    }
}
