"""``ray.experimental``: the parts of Ray's experimental APIs yrdask.ray has
(:mod:`~yrdask.ray.experimental.tqdm_ray`)."""
