"""Deployments of streamgr beyond one process: Ray Serve (``deploy.ray_serve``, the optional
extra ``streamgr[ray]``)."""
