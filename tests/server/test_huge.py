"""A huge prompt stalls nobody: refused before it is encoded when even its fewest tokens cannot fit,
and encoded off the event loop when it might, while other streams and /health go on."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from kvlayout.errors import BadRequest
from kvlayout.models import smollm2
from kvlayout.models.tokenizer import HFTokenizer
from kvlayout.server.requests import parse_completion
from tests.server.conftest import serving
from tests.server.test_monitor import SlowModel

STALL_BOUND_S = 0.5
HUGE = 1_000_000  # characters: under the 1 MiB body limit


def stream_gaps(live, body: dict, gaps: list, started: threading.Event) -> None:
    """Read a raw stream to its end, noting the time between two consecutive events."""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    raw = json.dumps({"model": "tiny", "stream": True, **body}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    seen, last = b"", None
    try:
        while b"data: [DONE]" not in seen:
            part = sock.recv(65536)
            if not part:
                break
            now = time.monotonic()
            if b"data: " in part:
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()
            seen += part
    finally:
        sock.close()


def health_latencies(live, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        live.health()
        out.append(time.monotonic() - t0)
        time.sleep(0.05)


def test_huge_chats_are_refused_at_once_naming_the_limit_and_stall_no_stream_nor_health(tiny_loaded):
    with serving(tiny_loaded, model=SlowModel(tiny_loaded[0], 0.05)) as live:
        gaps, started, stop, latencies = [], threading.Event(), threading.Event(), []
        body = {"prompt": "a long first request", "max_tokens": 200}
        streamer = threading.Thread(target=stream_gaps, args=(live, body, gaps, started))
        streamer.start()
        assert started.wait(20)
        watcher = threading.Thread(target=health_latencies, args=(live, stop, latencies))
        watcher.start()
        answers = []

        def huge() -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * HUGE}]}
            answers.append(live.post("/v1/chat/completions", body))

        senders = [threading.Thread(target=huge) for _ in range(4)]
        for s in senders:
            s.start()
        for s in senders:
            s.join(60)
        assert streamer.is_alive()  # the stream ran all the while the huge ones were read and refused
        streamer.join(60)
        stop.set()
        watcher.join(10)
        assert len(answers) == 4
        for status, body, _ in answers:
            assert status == 400
            error = body["error"]
            assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
            assert f"{live.service.limits.capacity} cells" in error["message"]
            assert error["type"] == "invalid_request_error"
        assert len(gaps) >= 20 and max(gaps) < STALL_BOUND_S
        assert latencies and max(latencies) < STALL_BOUND_S


def test_a_prompt_slow_to_encode_is_encoded_off_the_event_loop(tiny_loaded, monkeypatch):
    with serving(tiny_loaded) as live:
        tok = live.service.tokenizer
        plain_encode = tok.encode
        encoding = threading.Event()

        def slow_encode(text, add_special_tokens=True):  # a long encode (the real one lets go of the GIL too)
            if text.startswith("slow"):
                encoding.set()
                time.sleep(2.0)
            return plain_encode(text, add_special_tokens)

        monkeypatch.setattr(tok, "encode", slow_encode)
        answer = []
        sender = threading.Thread(target=lambda: answer.append(
            live.post("/v1/completions", {"model": "tiny", "prompt": "slow to encode", "max_tokens": 2})))
        sender.start()
        assert encoding.wait(10)
        t0 = time.monotonic()
        live.health()
        assert time.monotonic() - t0 < STALL_BOUND_S
        sender.join(30)
        assert answer and answer[0][0] == 200


def byte_level_tokenizer(tmp_path: Path, merges: int) -> HFTokenizer:
    """A byte-level BPE trained here on repetitive text (long tokens), as SmolLM2's is built."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_end|>"], show_progress=False)
    corpus = ["aaaaaaaaaaaaaaaa bbbbbbbb " * 50, "hello world, the quick brown fox " * 50, "----------------" * 20]
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, [0])


def random_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab -\n\t<|>im_end" + "".join(map(chr, range(1, 32))) + "éß漢字🙂"
    texts = ["a" * 5000, " " * 3000, "-" * 4000, "<|im_end|>" * 300, "\x14" * 100]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 3000))) for _ in range(40)]
    texts += ["".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(500)) for _ in range(5)]
    return [t for t in texts if not any(0xD800 <= ord(c) < 0xE000 for c in t)]


def test_the_fewest_tokens_of_a_byte_level_bpe_never_exceed_the_tokens_it_encodes_to(tmp_path):
    tok = byte_level_tokenizer(tmp_path, merges=200)
    bounded = 0
    for text in random_texts(0):
        fewest, count = tok.fewest_tokens(text), len(tok.encode(text))
        assert fewest <= count, (text[:40], fewest, count)
        bounded += fewest > 0
    assert bounded > 10  # the bound says something, not only 0


def test_the_bound_holds_for_smollm2s_tokenizer_which_lacks_some_bytes():
    # Found (or fetched once and cached) as every SmolLM2 test finds it: without it this fails saying why.
    path = smollm2.smollm2_dir(progress=lambda line: None) / "tokenizer.json"
    tok = HFTokenizer(path, [0])
    for text in [*random_texts(1), "\x14" * 10_000 + "a"]:  # 0x14 is not in its vocabulary: encoded to nothing
        assert tok.fewest_tokens(text) <= len(tok.encode(text))


def test_a_tokenizer_that_drops_whitespace_claims_no_bound(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    wrapped = HFTokenizer(tmp_path / "tokenizer.json", [0])
    assert len(wrapped.encode(" " * 1000)) == 0 and wrapped.fewest_tokens(" " * 1000) == 0


def test_a_completion_prompt_too_long_for_any_tokenization_is_refused_before_encoding(tiny_loaded):
    from kvlayout.server.requests import Limits

    class Counting(type(tiny_loaded[2])):
        def encode(self, text, add_special_tokens=True):
            raise AssertionError("encoded a prompt that could not fit")

    limits = Limits("m", 100, 50, 1, 258, 1.0, 1.0, 0)
    with pytest.raises(BadRequest) as caught:
        parse_completion({"model": "m", "prompt": "y" * 100}, limits, Counting())
    assert caught.value.param == "prompt" and "100 cells" in str(caught.value)
