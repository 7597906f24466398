# Example: SGLang's own image with specgov's in-engine plugin installed into its Python
# environment. specgov registers the entry point `sglang.srt.plugins: specgov`, which
# SGLang loads in every server process; SGLANG_PLUGINS=specgov allow-lists it.
#
#   python -m build --wheel --outdir dist .          # the specgov wheel
#   docker build -f deploy/docker/sglang-plugin.Dockerfile \
#     --build-arg SGLANG_IMAGE=<the SGLang 0.5.23 image you run> -t sglang-specgov .
#
# SGLANG_IMAGE must be an SGLang 0.5.23 image (the version specgov's contract tests check);
# the default below is a placeholder tag: use the one your registry mirrors.

ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}

# The same group id as the daemon's image: the spool is shared through it.
RUN groupadd --gid 10001 specgov
COPY dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/specgov-*.whl && rm -rf /tmp/dist

# Without SPECGOV_SPOOL_DIR, or without a valid table in it, the plugin chooses exactly
# what SGLang's own adaptive controller would.
# Two users (docs/spool-security.md): the server runs as its own user in group 10001 and
# follows only tables written by the daemon's uid 10001.
ENV SGLANG_PLUGINS=specgov \
    SPECGOV_SPOOL_DIR=/run/specgov/spool \
    SPECGOV_SPOOL_GROUP=10001 \
    SPECGOV_DAEMON_UID=10001
