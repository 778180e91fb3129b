# readie router: places calls on readie workers; runs no sandbox itself,
# so it needs neither runsc nor privileges, only Python and the workspace.
#
#   docker-compose build && docker-compose up      (see docs/deploy.md)

# uv: the version that wrote uv.lock (uv --version on the host), so --frozen reads it as written.
ARG UV_VERSION=0.13.9
FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM debian:bookworm-slim

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=uv /uv /usr/local/bin/uv

ENV UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PROJECT_ENVIRONMENT=/opt/readie/.venv
WORKDIR /opt/readie
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

HEALTHCHECK --interval=5s --timeout=4s --start-period=30s --retries=3 \
  CMD ["/opt/readie/.venv/bin/python", "/opt/readie/healthcheck.py", "127.0.0.1:50060"]
EXPOSE 50060
# SIGTERM drains: health turns NOT_SERVING, calls in flight finish, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/readie/.venv/bin/readie"]
CMD ["router", "--listen=0.0.0.0:50060", "--log=json"]
