#!/usr/bin/env bash
# Installs everything rolloutcore needs to build and test, from Debian's packages and PyPI.
# Idempotent: safe to run again; it only installs what is missing.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev
  libspdlog-dev libfmt-dev libxxhash-dev libsqlite3-dev sqlite3 libucx-dev
  clang clang-format clang-tidy libclang-rt-dev
  python3 python3-pip python3-dev pybind11-dev
  etcd-server iproute2
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "[install-deps] apt-get install: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[install-deps] Debian packages: all present"
fi

# Python packages used by tests and tools (pip installs only what is missing), as
# pip-name:import-name. scikit-build-core builds the Python package (`pip install .`).
PY_PACKAGES=(numpy:numpy pytest:pytest scikit-build-core:scikit_build_core)
py_missing=()
for entry in "${PY_PACKAGES[@]}"; do
  python3 -c "import ${entry#*:}" 2>/dev/null || py_missing+=("${entry%%:*}")
done
if [ ${#py_missing[@]} -gt 0 ]; then
  echo "[install-deps] pip install: ${py_missing[*]}"
  python3 -m pip install -q "${py_missing[@]}" || python3 -m pip install -q --break-system-packages "${py_missing[@]}"
else
  echo "[install-deps] Python packages: all present"
fi
