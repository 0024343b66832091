//! The codecs: they parse requests and write answers, and call the pipeline's phases in
//! between. [`h1`] is the fast HTTP/1.1 codec (how tollgate beats nginx on plain HTTP/1.1);
//! [`general`] is hyper (HTTP/2, TLS, upgrades, and whatever the fast codec hands over).

pub(crate) mod general;
pub(crate) mod h1;
