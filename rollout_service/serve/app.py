"""Ray Serve application builder (import path ``rollout_service.serve.app:build_app``)."""
