"""What a compile decided, for people: the typed records (`records`, `layout_record`), their text
(`text`), the report of a compiled module (`compile_report`), the predicted step (`timeline`)."""
