# Sourced by the GPU check scripts, from the repository root with PY set: installs the wheels
# carried in .whl/ (torchao, a peer of the gpt and linear suites) to /tmp/site and puts it on
# PYTHONPATH, installs fp8ops in editable mode, and prints the versions and the git revision.
#
#   gpu_install INSTALL_LOG VERSIONS_FILE   (returns 1 when fp8ops does not install)

gpu_install() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -m pip install --no-deps --no-build-isolation -e . > "$1" 2>&1 || { echo "install failed"; tail "$1"; return 1; }
    { "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
      git rev-parse HEAD 2>/dev/null; } | tee "$2"
}
