"""Task images: built from a task's Dockerfile by a real builder, pulled, cached, unpacked.

Shared by the providers (the docker provider runs the image, the local one unpacks it as the
bubblewrap root filesystem), so it lives beside them, never inside one. The pieces:
- `oci.ImageConfig`: the part of an image's OCI config a sandbox applies to every exec
  (ENV, USER, WORKDIR).
- `config.ImagesConfig`: mirrors, your aliases, the cache, the build network (a provider
  config's `images` field; MILES_ENV_REGISTRY_MIRROR / MILES_ENV_IMAGE_ALIASES add to it).
- `resolve.Resolver`: which image a `FROM` gets (alias, mirror, its registry, the loopback
  registry's bootstrapped Debian, a built-in substitute), as a pinned `ResolvedImage`.
- `context.plan_build`: a build's cache key and the Dockerfile the builder gets.
- `local.LocalImages`: buildah builds, unpacked once per key as a root filesystem (`LocalImage`).
- `bootstrap.bootstrap`: Debian bases from the Debian archive (mmdebstrap), pushed to the
  loopback registry (registry.py).
"""

from .config import ImagesConfig
from .errors import BaseUnavailable, ImageError
from .oci import ImageConfig
from .resolve import ResolvedImage

__all__ = ["BaseUnavailable", "ImageConfig", "ImageError", "ImagesConfig", "ResolvedImage"]
