"""Image generation: diffusers pipelines configured as models of kind `image`."""
