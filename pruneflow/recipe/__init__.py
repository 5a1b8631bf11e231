"""The recipe format: pydantic models, the loader with source positions, and the JSON schema."""

from .loader import LoadedRecipe, dump_recipe, load_recipe
from .models import DataSpec, GateSpec, ModelSpec, RecipeBase, recipe_model


def json_schema() -> dict:
    """JSON schema of the recipe format (every registered stage and target included)."""
    schema = recipe_model().model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "pruneflow recipe"
    return schema


__all__ = ["DataSpec", "GateSpec", "LoadedRecipe", "ModelSpec", "RecipeBase", "dump_recipe", "json_schema", "load_recipe", "recipe_model"]
