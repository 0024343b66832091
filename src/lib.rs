//! tollgate: a rate-limiting HTTP reverse proxy.
//!
//! A request's way through: accept ([`listener`]) → route ([`routing`]) → keys ([`key`]) →
//! decide ([`limit`]: local stores in process) → forward ([`proxy`]) → respond. Everything is
//! counted in [`metrics`]; [`config`] validates `routes.yaml` into the types a config
//! [`snapshot`] is built from, and [`app`] wires it all and runs it; [`admin`] serves the operator
//! endpoints on their own listener.

pub mod admin;
pub mod alloc;
pub mod app;
pub mod config;
pub mod connector;
#[doc(hidden)]
pub mod fuzzing;
pub mod key;
pub mod limit;
pub mod listener;
pub mod metrics;
pub mod proxy;
pub mod routing;
pub mod snapshot;
pub mod state;
pub mod tls;
