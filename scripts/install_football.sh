#!/usr/bin/env bash
# Build and install Google Research Football (gfootball 2.10.2) into the active Python
# environment, with the system packages its C++ engine needs (Debian/Ubuntu).
#
#   bash scripts/install_football.sh && pip install -e '.[football]'
#
# The engine is compiled once (about 5 minutes on 2 idle cores) into a wheel kept in
# $MAPPO_WHEEL_CACHE (default ~/.cache/mappo/wheels); later runs, and other virtual
# environments of the same Python, install that wheel in seconds.
set -euo pipefail

GFOOTBALL_VERSION=2.10.2
PACKAGES=(cmake build-essential libgl1-mesa-dev libsdl2-dev libsdl2-image-dev libsdl2-ttf-dev
  libsdl2-gfx-dev libboost-thread-dev libboost-system-dev libboost-filesystem-dev
  libboost-python-dev)

missing=()
for package in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  if [ "$status" != "install ok installed" ]; then missing+=("$package"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=()
  if [ "$(id -u)" != 0 ]; then sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  # Through env: sudo's env_reset would drop a plain variable assignment.
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${missing[@]}" >/dev/null
fi

cache="${MAPPO_WHEEL_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/mappo/wheels}"
mkdir -p "$cache"
# Without its declared dependencies: they include pygame (for playing with a keyboard), whose
# files would overwrite pygame-ce's (which PettingZoo's MPE uses), and the GUI build of OpenCV.
# What the game needs to run is the project's `football` extra: gym 0.23 (the last gym whose
# step() returns the 4-tuple gfootball expects), absl-py, six and headless OpenCV.
# pip picks a cached wheel only if it fits this interpreter and platform.
install=(python -m pip install -q --no-deps --no-index --find-links "$cache"
  "gfootball==$GFOOTBALL_VERSION")
if ! "${install[@]}" 2>/dev/null; then
  # The build script imports psutil with the environment's own Python, so the build runs
  # without pip's build isolation.
  python -m pip install -q psutil wheel setuptools
  python -m pip wheel -q --no-build-isolation --no-deps -w "$cache" \
    "gfootball==$GFOOTBALL_VERSION"
  "${install[@]}"
fi
