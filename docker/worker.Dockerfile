# readie worker: restores gVisor sandboxes from checkpoints captured on the host.
#
#   docker-compose build && docker-compose up      (see docs/deploy.md)
#
# The image holds runsc, Python and the workspace; the checkpoints and the
# sandbox rootfs they were captured from are mounted from the host, because a
# checkpoint only restores with the runsc version, rootfs path and mount plan
# that made it (the worker checks all three and says which one differs).

# uv: the version that wrote uv.lock (uv --version on the host), so --frozen reads it as written.
ARG UV_VERSION=0.13.9
FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM debian:bookworm-slim

# runsc as on the capturing host (scripts/install-runsc.sh: Debian trixie's
# 0.0~20240729, without trixie in the image's sources): the manifest records
# the version and flags, and a worker with others drops the checkpoints.
# iproute2, util-linux (unshare, nsenter) and nftables (libnftables1): networked sandboxes'
# namespaces and their egress firewall (decision 36).
COPY scripts/install-runsc.sh /tmp/install-runsc.sh
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 iproute2 util-linux nftables ca-certificates \
 && bash /tmp/install-runsc.sh --without-debian12 \
 && rm -rf /var/lib/apt/lists/* /tmp/install-runsc.sh

# The worker also runs uv at run time: per-call `packages` are installed on
# the worker host (wheels only) and mounted read-only into the sandbox.
COPY --from=uv /uv /usr/local/bin/uv

ENV UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PROJECT_ENVIRONMENT=/opt/readie/.venv \
    READIE_CACHE=/var/cache/readie
WORKDIR /opt/readie
# The workspace from uv.lock, exactly (--frozen), without dev tools, installed
# into the venv rather than linked to the source.
COPY pyproject.toml uv.lock .python-version ./
COPY executor executor
COPY policy policy
COPY worker worker
COPY rpc rpc
COPY pipeline pipeline
COPY protocol protocol
COPY pool pool
COPY router router
COPY client client
RUN uv sync --frozen --no-dev --no-editable --python /usr/bin/python3 \
 && /opt/readie/.venv/bin/readie --help
COPY docker/healthcheck.py /opt/readie/healthcheck.py

# Health: the gRPC health service turns NOT_SERVING as soon as a drain starts.
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 \
  CMD ["/opt/readie/.venv/bin/python", "/opt/readie/healthcheck.py", "127.0.0.1:50061"]
EXPOSE 50061
# SIGTERM drains: running jobs finish (up to --drain-grace), sandboxes are destroyed.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/readie/.venv/bin/readie"]
CMD ["worker", "--listen=0.0.0.0:50061", "--manifest=/srv/readie/checkpoints/manifest.json", "--log=json"]
