#!/usr/bin/env bash
# Build and install Google Research Football (gfootball 2.10.2) into the active Python
# environment, with the system packages its C++ engine needs (Debian/Ubuntu).
#
#   bash scripts/install_football.sh && pip install -e '.[football]'
#
# The engine is compiled once (4-12 minutes on 2 cores) into a wheel kept in
# $MAPPO_WHEEL_CACHE (default ~/.cache/mappo/wheels); later runs, and other virtual
# environments of the same Python version, install that wheel in seconds.
set -euo pipefail

GFOOTBALL_VERSION=2.10.2
PACKAGES=(cmake build-essential libgl1-mesa-dev libsdl2-dev libsdl2-image-dev libsdl2-ttf-dev
  libsdl2-gfx-dev libboost-thread-dev libboost-system-dev libboost-filesystem-dev
  libboost-python-dev)

if ! dpkg -s "${PACKAGES[@]}" >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${PACKAGES[@]}" >/dev/null
fi

cache="${MAPPO_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mappo/wheels}"
tag="cp$(python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
mkdir -p "$cache"
wheel=$(ls "$cache"/gfootball-"$GFOOTBALL_VERSION"-"$tag"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  # The build script imports psutil with the environment's own Python, so the build runs
  # without pip's build isolation.
  python -m pip install -q psutil wheel setuptools
  python -m pip wheel -q --no-build-isolation --no-deps -w "$cache" \
    "gfootball==$GFOOTBALL_VERSION"
  wheel=$(ls "$cache"/gfootball-"$GFOOTBALL_VERSION"-"$tag"-*.whl | head -n 1)
fi
# Without its declared dependencies: they include pygame (for playing with a keyboard), whose
# files would overwrite pygame-ce's (which PettingZoo's MPE uses), and the GUI build of OpenCV.
# What the game needs to run is the project's `football` extra: gym 0.23 (the last gym whose
# step() returns the 4-tuple gfootball expects), absl-py, six and headless OpenCV.
python -m pip install -q --no-deps "$wheel"
