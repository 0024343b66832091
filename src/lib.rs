//! tollgate: a rate-limiting HTTP reverse proxy.
//!
//! A request's way through: accept ([`listener`]) → route ([`routing`]) → keys ([`key`]) →
//! decide ([`limit`]: local stores in process) → forward ([`proxy`]) → respond. Everything is
//! counted in [`metrics`]; [`config`] validates `routes.yaml` into the types a config
//! [`snapshot`] is built from, and [`app`] wires it all and runs it; [`admin`] serves the operator
//! endpoints on their own listener.
#![warn(missing_docs, unreachable_pub)]

mod admin;
pub mod alloc;
pub mod app;
pub mod config;
mod connector;
#[doc(hidden)]
pub mod fuzzing;
pub mod key;
mod keytext;
pub mod limit;
mod listener;
pub mod metrics;
pub mod panics;
mod proxy;
mod routing;
mod snapshot;
mod state;
mod tls;
