"""The files a data source holds, by suffix: those read, those skipped as not text, those refused.

What the readers read (and how each is compressed),
what is skipped as not text, and what is refused by name rather than read as bytes of noise.
Shared by sources.py, which lists a local source, and hub.py, which chooses what to fetch."""

from __future__ import annotations

JSON_SUFFIXES = {".jsonl", ".json", ".ndjson"}
TEXT_SUFFIXES = {".txt", ".md", ".text"}
# lzma.open reads .lzma (LZMA "alone") files as well as .xz ones.
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".xz": "xz", ".lzma": "xz", ".bz2": "bzip2"}
# Read as text, these would be tokenised as bytes of noise: refused, naming the format.
UNREAD_COMPRESSIONS = {".lz4": "LZ4", ".br": "Brotli", ".lzo": "LZO", ".sz": "Snappy", ".snappy": "Snappy",
                       ".lz": "lzip", ".z": "compress (.Z)"}
ARCHIVES = {".zip": "ZIP", ".tar": "tar", ".tgz": "tar", ".tbz2": "tar", ".txz": "tar", ".tzst": "tar",
            ".7z": "7-Zip", ".rar": "RAR", ".jar": "JAR"}
SKIPPED_SUFFIXES = {".pyc", ".so", ".png", ".jpg", ".jpeg", ".gif", ".bin", ".exe", ".pdf", ".lock",
                    ".whl", ".npy", ".pt", ".safetensors", ".incomplete",
                    ".npz", ".pkl", ".pickle", ".gguf", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack", ".tfrecord",
                    ".db", ".sqlite", ".dll", ".dylib", ".pyd", ".class", ".bmp", ".tif", ".tiff", ".webp",
                    ".ico", ".mp3", ".wav", ".flac", ".ogg", ".mp4", ".ttf", ".otf", ".woff", ".woff2"}
READ_FORMATS = ("text, JSON lines (.jsonl, .json, .ndjson; plain or .gz, .zst, .xz, .bz2), .parquet, "
                "and folders of those or written by datasets' save_to_disk")
# What a Hub source fetches: what a build reads, plain and compressed (C4's shards are .json.gz);
# of text only .txt: a dataset's README.md is not its data.
DATA_SUFFIXES = (".parquet", ".arrow") + tuple(
    kind + comp for kind in (*sorted(JSON_SUFFIXES), ".txt") for comp in ("", *COMPRESSIONS))
