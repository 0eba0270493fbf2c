"""Task images: built from a task's Dockerfile by a real builder, pulled, cached, unpacked.

Shared by the providers (the docker provider runs the image, the local one unpacks it as the
bubblewrap root filesystem), so it lives beside them, never inside one. `oci.ImageConfig` is the
part of an image's OCI config a sandbox applies to every exec (ENV, USER, WORKDIR).
"""
