"""What a compile decided, for people: typed records, the tables (`compile_report`), the predicted
step (`timeline`)."""
