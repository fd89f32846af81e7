"""A seeded, generated product catalogue with WebShop-style goals and BM25 search.

Follows the WebShop paper's data description (Yao et al., 2022): products carry a
category path, a title, attributes, options, a price, and text (description, features,
reviews); a goal is sampled from one product (some of its attributes, one value of some
options, a price limit above its price) and rendered as an instruction "i need a ...
that is ..., and price lower than N dollars". Goals are shuffled once and split by index
into test, eval and train, as WebShop does (its 500 / 1,000 / rest of 12,087 become
1/9, 2/9 and 6/9 here). Nothing is copied from WebShop's code or data.

A catalogue is built once per config in a process (about 0.2 s for 1,500 products) and
shared read-only by all envs and threads.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import threading
import types

import numpy as np

from tidejax.envs.webshop_data import (
    BRAND_SYLLABLES,
    EXCLUSIVE_ATTRS,
    EXTRA_NOUNS,
    FEATURE_BLURBS,
    PRODUCT_TYPES,
    REVIEW_LINES,
    USES,
    ProductType,
)


def _import_bm25s() -> types.ModuleType:
    """Imports bm25s without letting it touch JAX.

    bm25s runs a JAX op at import whenever JAX is importable, which initialises the
    accelerator backend: in an env server on a GPU host that preallocates most of the
    GPU's memory, and in the trainer it can come before jax.distributed.initialize.
    BM25 here is numpy-only, so JAX is hidden from bm25s while it is imported (this
    module is imported once, normally on the main thread).
    """
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    name = "jax.lax" if "jax" in sys.modules else "jax"
    saved = sys.modules.get(name)
    sys.modules[name] = None  # type: ignore[assignment]  # makes `import jax.lax` fail
    try:
        import bm25s
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved
    return bm25s


bm25s = _import_bm25s()

RESULTS_TOP_K = 50  # WebShop's search engine returns 50 results, shown 10 per page
_WORD = re.compile(r"[a-z0-9]+")
_PRICE_BOUNDS = (10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 150, 200, 250, 300, 400, 500)
_OPTION_PHRASE = {
    "color": "{} color",
    "size": "size {}",
    "length": "{} length",
    "flavor": "{} flavor",
    "scent": "{} scent",
}


@dataclasses.dataclass(frozen=True)
class Product:
    asin: str
    title: str
    category: tuple[str, ...]
    query: str  # the search phrase the product is listed under (WebShop's "query")
    title_nouns: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (name, values offered)
    price: float
    description: str
    features: tuple[str, ...]
    reviews: tuple[str, ...]
    rating: float | None

    def option_values(self, name: str) -> tuple[str, ...]:
        return dict(self.options).get(name, ())

    def option_name_of(self, value: str) -> str | None:
        for name, values in self.options:
            if value in values:
                return name
        return None

    @functools.cached_property
    def text(self) -> str:
        """Lower-cased title, description and features: where attributes are looked up."""
        return " ".join((self.title, self.description, *self.features)).lower()


@dataclasses.dataclass(frozen=True)
class Goal:
    goal_id: int  # position in the catalogue's unshuffled goal list
    asin: str  # the product the goal was sampled from
    instruction: str
    query: str
    category: tuple[str, ...]
    title_nouns: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (name, wanted value)
    price_upper: float
    phrase: str  # the product-type phrase used in the instruction


@dataclasses.dataclass(frozen=True)
class CatalogueConfig:
    seed: int = 0
    n_products: int = 1500
    goals_per_product: int = 3
    test_fraction: float = 1 / 9
    eval_fraction: float = 2 / 9

    def __post_init__(self) -> None:
        if self.n_products < len(PRODUCT_TYPES):
            raise ValueError(f"n_products must be >= {len(PRODUCT_TYPES)}, got {self.n_products}")
        if self.goals_per_product < 1:
            raise ValueError(f"goals_per_product must be >= 1, got {self.goals_per_product}")
        if not (0 < self.test_fraction and 0 < self.eval_fraction):
            raise ValueError("test_fraction and eval_fraction must be > 0")
        if self.test_fraction + self.eval_fraction >= 1:
            raise ValueError("test_fraction + eval_fraction must be < 1")

    def split_sizes(self) -> dict[str, int]:
        n = self.n_products * self.goals_per_product
        n_test = max(1, round(n * self.test_fraction))
        n_eval = max(1, round(n * self.eval_fraction))
        return {"test": n_test, "eval": n_eval, "train": n - n_test - n_eval}


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Catalogue:
    """Products, goals by split, and a BM25 index over product text."""

    def __init__(self, config: CatalogueConfig):
        self.config = config
        rng = np.random.default_rng([config.seed, 0xC47A])
        self.brands = _make_brands(rng, 160)
        nouns = EXTRA_NOUNS | {w for b in self.brands for w in words(b)}
        self.products = tuple(_make_products(rng, config.n_products, self.brands, nouns))
        self.by_asin = {p.asin: i for i, p in enumerate(self.products)}
        self.goals = tuple(_make_goals(rng, self.products, config.goals_per_product))
        order = rng.permutation(len(self.goals))
        sizes = config.split_sizes()
        n_test, n_eval = sizes["test"], sizes["eval"]
        self.splits = {
            "test": tuple(int(i) for i in order[:n_test]),
            "eval": tuple(int(i) for i in order[n_test : n_test + n_eval]),
            "train": tuple(int(i) for i in order[n_test + n_eval :]),
        }
        corpus = [_search_text(p) for p in self.products]
        tokens = bm25s.tokenize(corpus, stopwords="en", show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index(tokens, show_progress=False)
        self._vocab = set(self._bm25.vocab_dict)

    def goal(self, split: str, index: int) -> Goal:
        ids = self.splits.get(split)
        if ids is None:
            raise ValueError(f"split must be one of {sorted(self.splits)}, got {split!r}")
        if not 0 <= index < len(ids):
            raise ValueError(f"goal_index {index} out of range for split {split!r} ({len(ids)})")
        return self.goals[ids[index]]

    def product(self, asin: str) -> Product:
        return self.products[self.by_asin[asin]]

    def search(self, query: str, k: int = RESULTS_TOP_K) -> list[int]:
        """Indices of the top-k products by BM25 score (ties by index); [] if no term hits."""
        toks = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        known = [t for t in toks[0] if t in self._vocab]
        if not known:
            return []
        scores = self._bm25.get_scores(known)
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        return [int(i) for i in order if scores[i] > 0.0]


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _cached(config: CatalogueConfig) -> Catalogue:
    return Catalogue(config)


def get_catalogue(config: CatalogueConfig | None = None) -> Catalogue:
    """The catalogue for `config`, built at most once per process."""
    with _LOCK:  # one build at a time; later callers get the cached one
        return _cached(config or CatalogueConfig())


def _make_brands(rng: np.random.Generator, n: int) -> list[str]:
    brands: list[str] = []
    seen: set[str] = set()
    while len(brands) < n:
        k = int(rng.integers(2, 4))
        name = "".join(BRAND_SYLLABLES[int(i)] for i in rng.integers(0, len(BRAND_SYLLABLES), k))
        if name not in seen and len(name) >= 4:
            seen.add(name)
            brands.append(name.capitalize())
    return brands


def _title_case(phrase: str) -> str:
    return " ".join(w if w.isupper() else w.capitalize() for w in phrase.split())


def _make_products(rng, n, brands, nouns) -> list[Product]:
    types = [PRODUCT_TYPES[i % len(PRODUCT_TYPES)] for i in range(n)]
    asins: set[str] = set()
    alphabet = np.array(list("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"))
    products = []
    for ptype in (types[int(i)] for i in rng.permutation(n)):
        while True:
            asin = "B0" + "".join(alphabet[rng.integers(0, len(alphabet), 8)])
            if asin not in asins:
                asins.add(asin)
                break
        products.append(_make_product(rng, asin, ptype, brands, nouns))
    return products


def _pick(rng, pool: tuple[str, ...], k: int) -> tuple[str, ...]:
    """k values of pool without replacement, in pool order (so text reads stably)."""
    idx = sorted(rng.permutation(len(pool))[:k].tolist())
    return tuple(pool[i] for i in idx)


def _pick_attributes(rng, pool: tuple[str, ...], k: int) -> tuple[str, ...]:
    """k attributes of pool, skipping any that contradict one already taken."""
    chosen: set[str] = set()
    for i in rng.permutation(len(pool)):
        a = pool[int(i)]
        if not any(a in group and chosen & group for group in EXCLUSIVE_ATTRS):
            chosen.add(a)
        if len(chosen) == k:
            break
    return tuple(a for a in pool if a in chosen)


def _make_product(rng, asin: str, ptype: ProductType, brands, nouns) -> Product:
    brand = brands[int(rng.integers(len(brands)))]
    attrs = _pick_attributes(rng, ptype.attributes, int(rng.integers(3, 6)))
    shown = [attrs[i] for i in sorted(rng.permutation(len(attrs))[:2].tolist())]
    descriptor = ptype.descriptors[int(rng.integers(len(ptype.descriptors)))]
    if rng.random() < 0.3:
        descriptor = ""
    head = " ".join(x for x in (brand, descriptor, ptype.title_noun) if x)
    title = f"{head} - {', '.join(_title_case(a) for a in shown)}"
    options = tuple(
        (name, _pick(rng, pool, int(rng.integers(2, min(6, len(pool)) + 1))))
        for name, pool in ptype.options
    )
    lo, hi = ptype.price
    price = float(np.floor(rng.uniform(lo, hi))) + 0.99
    uses = USES[ptype.category[0]]
    use = uses[int(rng.integers(len(uses)))]
    noun = ptype.title_noun.lower()
    description = (
        f"This {brand} {noun} is made for {use}. "
        f"It is {', '.join(attrs[:-1])} and {attrs[-1]}. "
        f"Sold by {brand}; ships in recyclable packaging."
    )
    blurbs = rng.permutation(len(FEATURE_BLURBS))
    features = tuple(
        f"{_title_case(a)}: {FEATURE_BLURBS[int(blurbs[i % len(blurbs)])]}"
        for i, a in enumerate(attrs)
    )
    reviews = tuple(
        f"{REVIEW_LINES[i][1]} stars: {REVIEW_LINES[i][0]}"
        for i in rng.permutation(len(REVIEW_LINES))[:2].tolist()
    )
    rating = None if rng.random() < 0.1 else round(float(rng.uniform(3.0, 5.0)), 1)
    title_words = words(title)
    title_nouns = tuple(dict.fromkeys(w for w in title_words if w in nouns))
    return Product(
        asin=asin,
        title=title,
        category=ptype.category,
        query=ptype.phrase,
        title_nouns=title_nouns,
        attributes=attrs,
        options=options,
        price=price,
        description=description,
        features=features,
        reviews=reviews,
        rating=rating,
    )


def _search_text(p: Product) -> str:
    opts = " ".join(v for _, values in p.options for v in values)
    return " ".join((p.title, p.category[-1], p.description, *p.features, opts))


def _make_goals(rng, products: tuple[Product, ...], per_product: int) -> list[Goal]:
    goals: list[Goal] = []
    plural = {t.phrase: t.plural for t in PRODUCT_TYPES}
    for product in products:
        for _ in range(per_product):
            attrs = _pick(rng, product.attributes, int(rng.integers(1, 4)))
            options = tuple(
                (name, values[int(rng.integers(len(values)))])
                for name, values in product.options
                if rng.random() < 0.85
            )
            above = [b for b in _PRICE_BOUNDS if b > product.price] or [
                int(np.ceil(product.price / 100.0) * 100 + 100)
            ]
            upper = float(above[1] if len(above) > 1 and rng.random() < 0.4 else above[0])
            text = _instruction(rng, product.query, plural[product.query], attrs, options, upper)
            goals.append(
                Goal(
                    goal_id=len(goals),
                    asin=product.asin,
                    instruction=text,
                    query=product.query,
                    category=product.category,
                    title_nouns=product.title_nouns,
                    attributes=attrs,
                    options=options,
                    price_upper=upper,
                    phrase=product.query,
                )
            )
    return goals


def _article(next_word: str, plural: bool) -> str:
    if plural:
        return ""
    return "an " if next_word[:1] in "aeiou" else "a "


def _instruction(rng, phrase, plural, attrs, options, upper) -> str:
    attr_text = attrs[0] if len(attrs) == 1 else f"{', '.join(attrs[:-1])} and {attrs[-1]}"
    opt_text = " and ".join(_OPTION_PHRASE.get(n, "{}").format(v) for n, v in options)
    price = f"price lower than {upper:.2f} dollars"
    form = int(rng.integers(4))
    if form == 0:
        clause = f", in {opt_text}" if opt_text else ""
        return f"i need {_article(phrase, plural)}{phrase} that is {attr_text}{clause}, and {price}"
    if form == 1:
        clause = f" with {opt_text}" if opt_text else ""
        art = _article(attr_text, plural)
        return f"i am looking for {art}{attr_text} {phrase}{clause}, and {price}"
    if form == 2:
        clause = f", and with {opt_text}" if opt_text else ""
        art = _article(phrase, plural)
        return f"i want to buy {art}{phrase} which is {attr_text}{clause}, and {price}"
    clause = f" in {opt_text}" if opt_text else ""
    return f"find me {_article(phrase, plural)}{phrase} with {attr_text}{clause}, and {price}"
