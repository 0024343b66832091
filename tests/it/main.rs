//! tollgate's integration tests, one binary: real sockets, real upstreams on loopback, the
//! binary as operators run it, a real redis-server and a real 3-node Redis Cluster started on
//! free ports by `support`. One binary links once instead of once per file (CI's disk and time).

mod support;

mod admin;
mod batch;
mod calendar;
mod cli;
mod concurrency;
mod consumer_keys;
mod delay;
mod eventual;
mod exchange_end;
mod fast_path;
mod fuzz_corpus;
mod gateway;
mod global;
mod http2;
mod key_flood;
mod lua_mirror;
mod packaging;
mod panics;
mod plans;
mod redis_cluster;
mod redis_store;
mod redis_tls;
mod reload;
mod reserve;
mod sentinel;
mod settle;
mod signals;
mod slot_queue;
mod tls;
mod upstream_pool;
