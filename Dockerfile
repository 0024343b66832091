# syntax=docker/dockerfile:1
#
# tollgate container image: build with the Rust toolchain, run on a slim Debian with only the
# binary, CA certificates (for https:// upstreams and rediss://) and a non-root user.
#
#   docker build -t tollgate .
#   docker run --rm -p 8080:8080 -p 9090:9090 -v "$PWD/routes.yaml:/etc/tollgate/routes.yaml:ro" \
#     tollgate run --config /etc/tollgate/routes.yaml --listen 0.0.0.0:8080 --admin 0.0.0.0:9090
#
# The admin listener (/metrics, /healthz, /readyz) must listen on 0.0.0.0 inside a container to
# be reachable: pass --admin 0.0.0.0:9090 or set server.admin in the mounted file.

FROM rust:1-bookworm AS builder
WORKDIR /src
# Only what the build reads (tests and docs are not needed; bench/ is named in Cargo.toml).
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY bench ./bench
# BuildKit cache mounts keep the registry and target/ between builds; the binary is copied out
# of the cache mount so the next stage can take it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin tollgate \
 && cp target/release/tollgate /usr/local/bin/tollgate \
 && strip --strip-debug /usr/local/bin/tollgate

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tollgate \
 && useradd --system --uid 10001 --gid tollgate --no-create-home --shell /usr/sbin/nologin tollgate
COPY --from=builder /usr/local/bin/tollgate /usr/local/bin/tollgate
# A default config so the image starts on its own; mount your own routes.yaml over it.
COPY deploy/routes.yaml /etc/tollgate/routes.yaml
USER 10001:10001
EXPOSE 8080 9090
ENV RUST_LOG=info
ENTRYPOINT ["tollgate"]
CMD ["run", "--config", "/etc/tollgate/routes.yaml"]
