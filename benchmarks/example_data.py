"""Synthetic stand-ins for the data sets the examples download.

Each function returns what the example's loading code returned (same
structure, shapes and types; fewer rows where `benchmarks.examples` says
so), drawn with a fixed seed so that every contender and every seed of a
run sees the same data, and with a rule planted in it so that there is
something to learn and a held-out score that means something:

- `mnist`: scikit-learn's 8x8 digits upsampled to 28x28 uint8 images, each
  shifted by up to 2 pixels and with pixel noise; train and test images come
  from disjoint digits.
- `imdb`: lists of word indices (Zipf-distributed, lengths like IMDB's) in
  which a label-dependent share of the "sentiment" words is positive.
- `movielens_ratings`: a ratings table (userId, movieId, rating in half
  stars, timestamp) from a low-rank model with user and movie biases and
  popular movies rated more often; `movielens_movies` its movies table.
- `heart`: the heart-disease table's 14 columns and types, the target from
  a logistic rule on a few of them.
- `tfds_movielens_100k`: the rows of TFDS' ``movielens/100k-ratings`` with
  its feature types (ids as strings, gender as bool, age as float32), the
  rating from a low-rank user x movie term plus a gender x age cross.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mnist", "imdb", "movielens_ratings", "movielens_movies", "heart", "tfds_movielens_100k"]

DATA_SEED = 1234


def _shifted(
    images8: np.ndarray, rng: np.random.Generator, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """`count` 28x28 uint8 images from 8x8 ones in [0, 16]: upsampled 3x,
    placed at a random offset (2 +- 2 pixels), with noise."""
    picks = rng.integers(len(images8), size=count)
    big = np.kron(images8[picks].reshape(-1, 8, 8), np.ones((3, 3))) * (255 / 16)
    out = np.zeros((count, 28, 28), dtype=np.float32)
    offsets = rng.integers(0, 5, size=(count, 2))
    for i, (dy, dx) in enumerate(offsets):
        out[i, dy : dy + 24, dx : dx + 24] = big[i]
    out += rng.normal(0, 20, size=out.shape)
    return np.clip(out, 0, 255).astype(np.uint8), picks


def mnist(train: int = 60_000, test: int = 10_000):
    """``((x_train, y_train), (x_test, y_test))`` as `keras.datasets.mnist.load_data()`."""
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(DATA_SEED)
    x, y = load_digits(return_X_y=True)
    order = rng.permutation(len(x))
    cut = int(0.8 * len(x))
    parts = []
    for idx, count in ((order[:cut], train), (order[cut:], test)):
        images, picks = _shifted(x[idx], rng, count)
        parts.append((images, y[idx][picks].astype(np.uint8)))
    return tuple(parts)


def imdb(num_words: int = 20_000, train: int = 25_000, test: int = 25_000):
    """``((x_train, y_train), (x_val, y_val))`` as `keras.datasets.imdb.load_data()`:
    object arrays of lists of word indices (1 starts a review, as there), labels 0/1."""
    rng = np.random.default_rng(DATA_SEED)
    # 50 positive and 50 negative words among the moderately frequent ones.
    sentiment = rng.choice(np.arange(min(50, num_words // 4), min(2000, num_words)), 100, False)
    positive, negative = sentiment[:50], sentiment[50:]
    ranks = np.arange(4, num_words)
    weights = 1.0 / ranks
    weights /= weights.sum()

    def split(count):
        labels = rng.integers(0, 2, size=count)
        reviews = np.empty(count, dtype=object)
        lengths = np.clip(rng.lognormal(5.3, 0.55, size=count).astype(int), 20, 1000)
        for i, (label, length) in enumerate(zip(labels, lengths)):
            words = rng.choice(ranks, size=length, p=weights)
            # About 1 word in 12 carries sentiment; 65% of them agree with the label.
            slots = np.flatnonzero(rng.random(length) < 1 / 12)
            agree = rng.random(len(slots)) < 0.65
            good = agree == bool(label)
            words[slots[good]] = rng.choice(positive, size=int(good.sum()))
            words[slots[~good]] = rng.choice(negative, size=int((~good).sum()))
            reviews[i] = [1, *words.tolist()]
        return reviews, labels.astype(np.int64)

    return split(train), split(test)


def movielens_ratings(ratings: int = 100_836, users: int = 610, movies: int = 9_724):
    """The ``ratings.csv`` table of MovieLens' ml-latest-small, as a DataFrame."""
    import pandas as pd

    rng = np.random.default_rng(DATA_SEED)
    rank = 4
    u = rng.normal(0, 0.5, size=(users, rank))
    v = rng.normal(0, 0.5, size=(movies, rank))
    user_bias = rng.normal(0, 0.4, size=users)
    movie_bias = rng.normal(0, 0.5, size=movies)
    popularity = 1.0 / np.arange(1, movies + 1) ** 0.8
    popularity /= popularity.sum()
    user_ids = rng.integers(users, size=ratings)
    movie_ids = rng.choice(movies, size=ratings, p=popularity)
    score = 3.5 + user_bias[user_ids] + movie_bias[movie_ids]
    score += np.sum(u[user_ids] * v[movie_ids], axis=1) + rng.normal(0, 0.4, size=ratings)
    stars = np.clip(np.round(score * 2) / 2, 0.5, 5.0)
    frame = pd.DataFrame(
        {
            # Ids as MovieLens numbers them: from 1, movie ids sparse.
            "userId": user_ids + 1,
            "movieId": movie_ids * 3 + 1,
            "rating": stars,
            "timestamp": rng.integers(828_124_615, 1_537_799_250, size=ratings),
        }
    )
    return frame.drop_duplicates(["userId", "movieId"]).reset_index(drop=True)


def movielens_movies(movies: int = 9_724):
    """The ``movies.csv`` table (movieId, title, genres) for `movielens_ratings`."""
    import pandas as pd

    genres = ["Action", "Comedy", "Drama", "Romance", "Thriller"]
    return pd.DataFrame(
        {
            "movieId": np.arange(movies) * 3 + 1,
            "title": [f"Movie {i}" for i in range(movies)],
            "genres": [genres[i % len(genres)] for i in range(movies)],
        }
    )


def heart(rows: int = 303):
    """The heart-disease CSV's table: 13 features and ``target``."""
    import pandas as pd

    rng = np.random.default_rng(DATA_SEED)
    n = rows
    frame = pd.DataFrame(
        {
            "age": rng.integers(29, 78, size=n),
            "sex": rng.integers(0, 2, size=n),
            "cp": rng.integers(0, 5, size=n),
            "trestbps": rng.normal(131, 17, size=n).round().astype(int),
            "chol": rng.normal(246, 51, size=n).round().astype(int),
            "fbs": (rng.random(n) < 0.15).astype(int),
            "restecg": rng.integers(0, 3, size=n),
            "thalach": rng.normal(150, 23, size=n).round().astype(int),
            "exang": (rng.random(n) < 0.33).astype(int),
            "oldpeak": np.abs(rng.normal(0, 1.4, size=n)).round(1),
            "slope": rng.integers(1, 4, size=n),
            "ca": rng.integers(0, 4, size=n),
            "thal": rng.choice(["normal", "fixed", "reversible"], size=n, p=[0.55, 0.1, 0.35]),
        }
    )
    logit = (
        -0.3
        + 0.6 * (frame["cp"] >= 3)
        + 0.9 * frame["exang"]
        + 0.8 * (frame["oldpeak"] - 1.1)
        + 0.6 * frame["ca"]
        - 0.04 * (frame["thalach"] - 150)
        + 1.2 * (frame["thal"] == "reversible")
        - 0.8 * frame["sex"] * (frame["age"] < 50)
    )
    frame["target"] = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    return frame


def tfds_movielens_100k(ratings: int = 100_000, users: int = 943, movies: int = 1_682):
    """A `tf.data.Dataset` of dicts as ``tfds.load("movielens/100k-ratings", split="train")``
    gives them, with the features the DCN example reads."""
    import tensorflow as tf

    rng = np.random.default_rng(DATA_SEED)
    rank = 3
    u = rng.normal(0, 0.6, size=(users, rank))
    v = rng.normal(0, 0.6, size=(movies, rank))
    gender = rng.random(users) < 0.7
    age_buckets = np.array([1, 18, 25, 35, 45, 50, 56], dtype=np.float32)
    age = rng.choice(age_buckets, size=users)
    occupations = np.array(
        [b"student", b"engineer", b"educator", b"writer", b"artist", b"doctor", b"other"]
    )
    occupation = rng.choice(occupations, size=users)
    zips = np.array([f"{z:05d}".encode() for z in rng.integers(0, 99_999, size=700)])
    zip_code = rng.choice(zips, size=users)
    movie_bias = rng.normal(0, 0.5, size=movies)
    movie_kind = rng.integers(0, 2, size=movies)  # crossed with gender and age
    popularity = 1.0 / np.arange(1, movies + 1) ** 0.7
    popularity /= popularity.sum()
    user_idx = rng.integers(users, size=ratings)
    movie_idx = rng.choice(movies, size=ratings, p=popularity)
    young = age[user_idx] < 30
    cross = 0.8 * np.where(gender[user_idx] == (movie_kind[movie_idx] == 1), 1, -1) * young
    score = 3.5 + movie_bias[movie_idx] + np.sum(u[user_idx] * v[movie_idx], axis=1) + cross
    score += rng.normal(0, 0.5, size=ratings)
    rating = np.clip(np.round(score), 1, 5).astype(np.float32)
    features = {
        "movie_id": np.array([str(m + 1).encode() for m in movie_idx]),
        "user_id": np.array([str(x + 1).encode() for x in user_idx]),
        "user_gender": gender[user_idx],
        "bucketized_user_age": age[user_idx],
        "user_zip_code": zip_code[user_idx],
        "user_occupation_text": occupation[user_idx],
        "user_rating": rating,
    }
    return tf.data.Dataset.from_tensor_slices(features)
