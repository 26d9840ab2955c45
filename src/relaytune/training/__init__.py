"""Training: the recipe, the trainer that holds the live objects, and the guards around each step."""
