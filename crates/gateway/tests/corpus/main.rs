//! The fuzz targets' corpora, run as tests on stable: a module per target.

mod agents;
mod fields;
mod sse;
