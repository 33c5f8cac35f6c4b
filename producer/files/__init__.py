"""Files: OpenAI's file objects, their bytes in the file store and their records in Redis."""
