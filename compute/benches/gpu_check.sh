#!/usr/bin/env bash
# Checks shoal on a machine with an NVIDIA GPU, in one run: builds the release binary, runs the
# CUDA agreement tests (and the wgpu ones where the driver's Vulkan part is installed), then
# times training steps of micro, mini and gpt2 on CUDA and wgpu next to PyTorch eager on CUDA,
# against the goals: on gpt2, CUDA at most 1.2x PyTorch's step time and wgpu within 3x of CUDA.
#
# Needs the NVIDIA driver, a Rust toolchain, a C compiler and python3 with venv; PyTorch (its
# CUDA wheel), NVRTC and cuBLAS come from PyPI into target/ (PIP_INDEX_URL and friends reach
# pip as usual). Where python3 already has PyTorch with CUDA, that one is used, and NVRTC and
# cuBLAS libraries already on the machine (CUDA toolkit, PyTorch's wheels) are used when the
# driver can run what they produce. On a machine without a Rust toolchain or network, build
# elsewhere with compute/benches/gpu_prebuild.sh DIR and pass GPU_CHECK_PREBUILT=DIR. Stdout gets one JSON object: the summary, or {"status":"missing",...} before
# anything is built when something is missing. Progress goes to stderr, each command's output
# to target/gpu-check/. Exit status: 2 something missing, 1 a stage failed or ran out of time,
# else 0 (goals met or not). The run keeps within GPU_CHECK_BUDGET_S seconds (default 540).
#
#   compute/benches/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s.%N)
venv=target/gpu-check-venv
libs=target/gpu-check-cuda-libs
out=target/gpu-check

json_str() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\t'/ }
  printf '%s' "${s//$'\n'/ }"
}

# Everything is checked before anything is built, so a bare machine learns all it lacks at once.
missing_what=() missing_fix=()
need() { missing_what+=("$1"); missing_fix+=("$2"); }

gpus="" driver="" driver_cuda=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  need nvidia-smi "install the NVIDIA driver (e.g. apt-get install nvidia-driver-550-server)"
elif list=$(timeout 30 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1) &&
  [ -n "$list" ]; then
  gpus=$(cut -d, -f1 <<<"$list")
  driver=$(head -n1 <<<"$list" | cut -d, -f2 | tr -d ' ')
  driver_cuda=$(timeout 30 nvidia-smi 2>/dev/null |
    sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1) || true
  if [ -n "$driver_cuda" ] && [ "${driver_cuda%%.*}" -lt 12 ]; then
    need "an NVIDIA driver for CUDA 12" \
      "this driver ($driver) supports CUDA $driver_cuda; install driver 525 or newer"
  fi
else
  why=$(head -n1 <<<"${list:-no output}")
  need "an NVIDIA GPU" "nvidia-smi lists none ($why); check that the driver is loaded"
fi

# Binaries built elsewhere (gpu_prebuild.sh): shoal and the test executables.
prebuilt=${GPU_CHECK_PREBUILT:-}
if [ -n "$prebuilt" ]; then
  for b in shoal cuda-tests; do
    [ -x "$prebuilt/$b" ] ||
      need "$prebuilt/$b" "build it with compute/benches/gpu_prebuild.sh $prebuilt (GPU_CHECK_PREBUILT)"
  done
fi

rust_min=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
if [ -n "$prebuilt" ]; then
  :
elif ! command -v cargo >/dev/null 2>&1; then
  need cargo "install Rust $rust_min or newer with rustup (https://rustup.rs)"
else
  rust_have=$(cargo --version 2>/dev/null || true)
  rust_have=${rust_have#cargo }
  rust_have=${rust_have%% *}
  if [ -z "$rust_have" ]; then
    need "a Rust toolchain" "rustup default stable"
  elif [ "$(printf '%s\n' "$rust_min" "$rust_have" | sort -V | head -n1)" != "$rust_min" ]; then
    need "Rust $rust_min or newer" "rustup update stable (cargo here is $rust_have)"
  fi
fi
# Rust links through cc, and aws-lc-sys and zstd-sys compile C.
if [ -z "$prebuilt" ] && ! command -v cc >/dev/null 2>&1; then
  need "cc (C compiler and linker)" "apt-get install build-essential"
fi

# A python3 whose PyTorch already runs on the GPU is used as it is (no venv, no download).
torch_py=""
if command -v python3 >/dev/null 2>&1 &&
  timeout 120 python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
    >/dev/null 2>&1; then
  torch_py=python3
fi
if ! command -v python3 >/dev/null 2>&1; then
  need python3 "apt-get install python3 python3-venv"
elif [ -z "$torch_py" ] && [ ! -x "$venv/bin/python" ] &&
  ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  # Debian and Ubuntu ship venv and the pip it installs (ensurepip) apart from python3.
  need "python3 venv with pip" "apt-get install python3-venv"
fi
command -v timeout >/dev/null 2>&1 || need timeout "apt-get install coreutils"

if [ ${#missing_what[@]} -gt 0 ]; then
  items=""
  for i in "${!missing_what[@]}"; do
    echo "missing: ${missing_what[$i]}: ${missing_fix[$i]}" >&2
    items+="${items:+,}{\"what\":\"$(json_str "${missing_what[$i]}")\""
    items+=",\"fix\":\"$(json_str "${missing_fix[$i]}")\"}"
  done
  printf '{"status":"missing","missing":[%s]}\n' "$items"
  exit 2
fi

budget=${GPU_CHECK_BUDGET_S:-540}
# The summary needs a few seconds, and timeout -k may take 10 more to kill a stage.
deadline=$((budget - 20))
rm -rf "$out"
mkdir -p "$out"
export CARGO_TERM_COLOR=never

# Stages run under timeout, in its process group, which a Ctrl-C at the terminal does not reach.
stop() {
  local pid
  if [ -f "$out/pids" ]; then
    while read -r pid; do kill -TERM -- "-$pid" 2>/dev/null || true; done <"$out/pids"
  fi
  exit 130
}
trap stop INT TERM

# stage NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS (fewer when the budget is
# nearly spent), stdout and stderr to $out/NAME.out and .err, and records how it ended in
# $out/NAME.stage for the summary. Returns 0 whatever happened: a failed stage is recorded and
# the next one runs.
stage() {
  local name=$1 limit=$2 rc=0 pid start=$SECONDS
  shift 2
  if [ $((deadline - SECONDS)) -lt "$limit" ]; then limit=$((deadline - SECONDS)); fi
  if [ "$limit" -lt 5 ]; then
    skip "$name" "no time left in the ${budget} s budget (GPU_CHECK_BUDGET_S)" timeout
    return 0
  fi
  echo "== $name (at most $limit s)" >&2
  local t_start
  t_start=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err" &
  pid=$!
  echo "$pid" >>"$out/pids"
  wait "$pid" || rc=$?
  printf 'rc=%s\nstart=%s\nend=%s\nlimit=%s\n' "$rc" "$t_start" "$(date +%s.%N)" "$limit" \
    >"$out/$name.stage"
  case $rc in
    0) echo "== $name: ok ($((SECONDS - start)) s)" >&2 ;;
    124 | 137) echo "== $name: timed out after $limit s (see $out/$name.err)" >&2 ;;
    *) echo "== $name: failed, exit status $rc (see $out/$name.err)" >&2 ;;
  esac
}

# skip NAME REASON [timeout]: records a stage that did not run, and why.
skip() {
  printf 'skipped=%s\n' "$2" >"$out/$1.stage"
  if [ "${3:-}" = timeout ]; then echo "timeout=1" >>"$out/$1.stage"; fi
  echo "== $1: skipped: $2" >&2
}

ok() { grep -qx 'rc=0' "$out/$1.stage" 2>/dev/null; }

has_vulkan_loader() {
  PATH=$PATH:/sbin:/usr/sbin ldconfig -p 2>/dev/null | grep 'libvulkan\.so\.1' >/dev/null
}

# NVRTC newer than the driver writes PTX the driver cannot load, so both libraries are taken
# from the driver's CUDA 12 minor release or older. They go to their own folder, apart from
# PyTorch's (which may be another CUDA release), and reach shoal through LD_LIBRARY_PATH.
# PyPI's torch is built for CUDA 13 from 2.11 on; 2.10 is the last for CUDA 12 (12.8).
pin="" torch=torch
if [ "${driver_cuda%%.*}" = 12 ]; then
  minor=${driver_cuda#12.}
  pin="<12.$((${minor%%.*} + 1))"
  torch="torch<2.11"
fi
# NVRTC and cuBLAS already on the machine (a CUDA toolkit, PyTorch's wheels) serve where the
# driver runs what they produce: NVRTC of the driver's CUDA release or older, cuBLAS of its
# major release or older. The CUDA backend looks for CUDA 12's names or unversioned ones, so
# each is linked under its plain name in a folder of its own.
version_le() { [ "$(printf '%s\n' "$1" "$2" | sort -V | head -n1)" = "$1" ]; }
# local_lib NAME MAX: the newest NAME.so.* on the machine whose version, cut to MAX's number of
# components, is MAX or older.
local_lib() {
  local name=$1 max=$2 f real v cut best="" bestv=""
  while read -r f; do
    real=$(readlink -f "$f") || continue
    v=${real##*/"$name".so.}
    [[ $v =~ ^[0-9]+(\.[0-9]+)*$ ]] || continue
    cut=$(cut -d. -f1-"$(tr -cd . <<<"$max." | wc -c)" <<<"$v")
    if version_le "$cut" "$max" && { [ -z "$bestv" ] || version_le "$bestv" "$v"; }; then
      best=$real bestv=$v
    fi
  done < <({
    PATH=$PATH:/sbin:/usr/sbin ldconfig -p 2>/dev/null | sed -n "s/.*=> \(.*\/$name\.so\..*\)$/\1/p"
    find /usr/local /usr/lib /opt -name "$name.so.*" 2>/dev/null
  } | sort -u)
  printf '%s' "$best"
}
local_nvrtc="" local_cublas=""
if [ -n "$driver_cuda" ]; then
  local_nvrtc=$(local_lib libnvrtc "$(cut -d. -f1-2 <<<"$driver_cuda")")
  local_cublas=$(local_lib libcublas "${driver_cuda%%.*}")
fi
if [ -n "$local_nvrtc" ] && [ -n "$local_cublas" ]; then
  rm -rf "$libs/links"
  mkdir -p "$libs/links"
  ln -s "$local_nvrtc" "$libs/links/libnvrtc.so"
  ln -s "$local_cublas" "$libs/links/libcublas.so"
  echo "== using $local_nvrtc and $local_cublas" >&2
  cuda_lib_path=$PWD/$libs/links:$(dirname "$local_nvrtc"):$(dirname "$local_cublas")
else
  cuda_lib_path=$PWD/$libs/nvidia/cuda_nvrtc/lib:$PWD/$libs/nvidia/cublas/lib
fi
cuda_vars=("LD_LIBRARY_PATH=$cuda_lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")

need_venv=""
if [ -z "$torch_py" ] || [ -z "$local_nvrtc" ] || [ -z "$local_cublas" ]; then need_venv=1; fi
if [ -n "$need_venv" ] && [ ! -x "$venv/bin/python" ]; then
  stage venv 120 python3 -m venv "$venv"
fi
# The downloads run while shoal builds; they are waited for where they are needed.
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
libs_pid="" torch_pid=""
if [ -n "$local_nvrtc" ] && [ -n "$local_cublas" ]; then
  :
elif [ -x "$venv/bin/python" ]; then
  stage cuda_libs 300 "${pip[@]}" --upgrade --target "$libs" \
    "nvidia-cuda-nvrtc-cu12$pin" "nvidia-cublas-cu12$pin" &
  libs_pid=$!
else
  skip cuda_libs "no Python venv (see venv)"
fi
if [ -n "$torch_py" ]; then
  echo "== using $torch_py's PyTorch" >&2
elif [ -x "$venv/bin/python" ]; then
  stage torch_install 420 "${pip[@]}" "$torch" &
  torch_pid=$!
  torch_py=$venv/bin/python
else
  skip torch_install "no Python venv (see venv)"
fi

if [ -n "$prebuilt" ]; then
  shoal=$(readlink -f "$prebuilt/shoal")
  printf 'rc=0\nstart=%s\nend=%s\nlimit=0\nprebuilt=%s\n' "$(date +%s.%N)" "$(date +%s.%N)" \
    "$prebuilt" >"$out/build.stage"
else
  stage build 330 cargo build --release -p shoal-node
  shoal=$PWD/target/release/shoal
fi

icd=""
for f in ${VK_DRIVER_FILES//:/ } /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json; do
  if [ -e "$f" ] && grep -qi nvidia "$f"; then
    icd=$f
    break
  fi
done
if [ -n "$icd" ] && ! has_vulkan_loader && command -v apt-get >/dev/null 2>&1; then
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then sudo=(sudo -n); fi
  stage vulkan_loader 120 "${sudo[@]}" sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libvulkan1'
fi
wgpu_skip=""
if [ -z "$icd" ]; then
  wgpu_skip="no Vulkan driver for NVIDIA (nvidia_icd.json in /usr/share/vulkan/icd.d or"
  wgpu_skip+=" /etc/vulkan/icd.d): install the driver's Vulkan part (e.g. libnvidia-gl-550-server)"
elif ! has_vulkan_loader; then
  wgpu_skip="no Vulkan loader (libvulkan.so.1): apt-get install libvulkan1"
elif [ -n "$prebuilt" ] && [ ! -x "$prebuilt/wgpu-tests" ]; then
  wgpu_skip="$prebuilt/wgpu-tests is missing (gpu_prebuild.sh builds it)"
fi
# wgpu runs on NVIDIA's Vulkan driver alone, so a software one (Mesa's lavapipe) that is also
# installed can neither stand in for it in the checks nor slow `shoal devices --bench` down.
vk_vars=()
if [ -n "$icd" ]; then vk_vars=("VK_DRIVER_FILES=$icd" "VK_ICD_FILENAMES=$icd"); fi

if [ -n "$prebuilt" ]; then
  cuda_test=("$prebuilt/cuda-tests") wgpu_test=("$prebuilt/wgpu-tests")
  printf 'rc=0\nstart=%s\nend=%s\nlimit=0\nprebuilt=%s\n' "$(date +%s.%N)" "$(date +%s.%N)" \
    "$prebuilt" >"$out/test_build.stage"
else
  tests=(--test cuda)
  if [ -z "$wgpu_skip" ]; then tests+=(--test wgpu); fi
  stage test_build 240 cargo test --release -p shoal-compute "${tests[@]}" --no-run
  cuda_test=(cargo test --release -p shoal-compute --test cuda --)
  wgpu_test=(cargo test --release -p shoal-compute --test wgpu --)
fi
if [ -n "$libs_pid" ]; then wait "$libs_pid" || true; fi
if ok test_build; then
  # The agreement tests are ignored where there is no GPU; here they must run.
  stage cuda_tests 120 env "${cuda_vars[@]}" "${cuda_test[@]}" --include-ignored
  if [ -n "$wgpu_skip" ]; then
    skip wgpu_tests "$wgpu_skip"
  else
    stage wgpu_tests 120 env "${vk_vars[@]}" "${wgpu_test[@]}"
  fi
else
  skip cuda_tests "the test build failed (see test_build)"
  skip wgpu_tests "the test build failed (see test_build)"
fi

if ok build; then
  stage devices 60 env "${cuda_vars[@]}" "${vk_vars[@]}" "$shoal" devices --bench
else
  skip devices "the build failed (see build)"
fi

# 8192 tokens a step in every preset, enough to keep a large GPU busy; gpt2's 8 x 1024 keeps its
# logits (1.6 GB) within 2 GiB, lavapipe's limit on one wgpu buffer (drivers differ).
presets=(gpt2:8 mini:32 micro:64)
torch_waited=""
for pb in "${presets[@]}"; do
  preset=${pb%%:*} batch=${pb#*:}
  args=(--preset "$preset" --batch "$batch" --json)
  if ok build; then
    stage "bench_cuda_$preset" 90 env "${cuda_vars[@]}" \
      "$shoal" bench compute --backend cuda "${args[@]}" --steps 10
  else
    skip "bench_cuda_$preset" "the build failed (see build)"
  fi
  if ! ok build; then
    skip "bench_wgpu_$preset" "the build failed (see build)"
  elif [ -n "$wgpu_skip" ]; then
    skip "bench_wgpu_$preset" "no Vulkan for NVIDIA (see wgpu_tests)"
  else
    # Seconds a step on an H200 (gpt2 ~15 s): fewer steps, so that it fits its time.
    stage "bench_wgpu_$preset" 150 env "${vk_vars[@]}" \
      "$shoal" bench compute --backend wgpu "${args[@]}" --steps 3 --warmup 1
  fi
  if [ -n "$torch_pid" ] && [ -z "$torch_waited" ]; then
    wait "$torch_pid" || true
    torch_waited=1
  fi
  if [ -n "$torch_py" ] && { [ -z "$torch_pid" ] || ok torch_install; }; then
    stage "bench_torch_$preset" 120 "$torch_py" compute/benches/torch_reference.py \
      --device cuda "${args[@]}" --steps 10
  else
    skip "bench_torch_$preset" "PyTorch did not install (see torch_install)"
  fi
done

python3 - "$out" "$t0" "$budget" "$driver" "$driver_cuda" "${presets[*]}" "$gpus" <<'PY'
import json, os, re, sys, time

out, t0, budget, driver, driver_cuda, presets, gpus = sys.argv[1:8]


def read(name, ext):
    try:
        with open(os.path.join(out, f"{name}.{ext}"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def last_line(name):
    for ext in ("err", "out"):
        lines = [l.strip() for l in read(name, ext).splitlines() if l.strip()]
        if lines:
            return lines[-1][:300]
    return ""


def stage(name):
    kv = dict(l.split("=", 1) for l in read(name, "stage").splitlines() if "=" in l)
    if "skipped" in kv:
        return {"status": "timeout" if "timeout" in kv else "skipped", "reason": kv["skipped"]}
    if "rc" not in kv:
        return {"status": "not run"}
    rc = int(kv["rc"])
    r = {"status": "ok", "seconds": round(float(kv["end"]) - float(kv["start"]), 1)}
    if rc in (124, 137):
        r.update(status="timeout", error=f"timed out after {kv['limit']} s")
    elif rc != 0:
        r.update(status="failed", rc=rc, error=last_line(name))
    return r


def tests(name):
    r = stage(name)
    text = read(name, "out")
    counts = [0, 0, 0]
    for m in re.finditer(r"(\d+) passed; (\d+) failed; (\d+) ignored", text):
        counts = [c + int(v) for c, v in zip(counts, m.groups())]
    if "seconds" in r or counts != [0, 0, 0]:
        r.update(passed=counts[0], failed=counts[1], ignored=counts[2])
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", text, re.M)
    if failed:
        r["failed_tests"] = failed[:20]
        # The first panic's message says why (a missing library, a device error, a tolerance).
        m = re.search(r"panicked at [^\n]*\n([^\n]+)", text + read(name, "err"))
        if m:
            r["error"] = m.group(1).strip()[:300]
    return r


def bench(name):
    r = stage(name)
    for line in reversed(read(name, "out").splitlines()):
        if line.startswith("{"):
            try:
                b = json.loads(line)
            except ValueError:
                continue
            r["device"] = b.get("backend") or b.get("device")
            for k in ("step_ms_median", "step_ms_min", "tokens_per_s", "gflops"):
                if k in b:
                    r[k] = round(b[k], 3 if k == "step_ms_median" else 1)
            if "torch_version" in b:
                r["torch_version"] = b["torch_version"]
            break
    return r


def ratio(a, b):
    if a.get("step_ms_median") and b.get("step_ms_median"):
        return round(a["step_ms_median"] / b["step_ms_median"], 3)
    return None


names = [n.strip() for n in gpus.splitlines() if n.strip()]
summary = {"status": "ok", "gpu": names[0] if names else None, "gpus": names,
           "driver": driver, "driver_cuda": driver_cuda or None}
setup = {n: stage(n) for n in ("venv", "cuda_libs", "torch_install", "build", "test_build",
                               "vulkan_loader") if read(n, "stage")}
summary["build_seconds"] = setup.get("build", {}).get("seconds")
summary["prebuilt"] = os.environ.get("GPU_CHECK_PREBUILT") or None
summary["setup"] = setup
summary["tests"] = {"cuda": tests("cuda_tests"), "wgpu": tests("wgpu_tests")}
devices = stage("devices")
if devices["status"] == "ok":
    devices["output"] = [l.rstrip() for l in read("devices", "out").splitlines() if l.strip()]
summary["devices"] = devices
benches = {}
for pb in presets.split():
    preset, batch = pb.split(":")
    p = {"batch": int(batch)}
    for backend in ("cuda", "wgpu", "torch"):
        p[backend] = bench(f"bench_{backend}_{preset}")
    p["cuda_over_torch"] = ratio(p["cuda"], p["torch"])
    p["wgpu_over_cuda"] = ratio(p["wgpu"], p["cuda"])
    benches[preset] = p
summary["bench"] = benches
gpt2 = benches.get("gpt2", {})
summary["goals"] = {
    name: {"max": most, "ratio": gpt2.get(key),
           "met": None if gpt2.get(key) is None else gpt2[key] <= most}
    for name, key, most in (("cuda_over_torch_gpt2", "cuda_over_torch", 1.2),
                            ("wgpu_over_cuda_gpt2", "wgpu_over_cuda", 3.0))
}
failed = [f"setup.{n}" for n, r in setup.items() if r["status"] not in ("ok", "skipped")]
failed += [f"tests.{n}" for n, r in summary["tests"].items()
           if r["status"] not in ("ok", "skipped")]
if devices["status"] not in ("ok", "skipped"):
    failed.append("devices")
failed += [f"bench.{p}.{b}" for p, r in benches.items() for b in ("cuda", "wgpu", "torch")
           if r[b]["status"] not in ("ok", "skipped")]
summary["failed"] = failed
if failed:
    summary["status"] = "failed"
summary["seconds"] = round(time.time() - float(t0), 1)
summary["budget_s"] = int(budget)
summary["logs"] = out
print(json.dumps(summary))
sys.exit(1 if failed else 0)
PY
