"""Test configuration: four logical CPU devices, made before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_diffmap  # noqa: E402

NUM_CPU_DEVICES = 4
tf_diffmap.split_devices(NUM_CPU_DEVICES, "CPU")
