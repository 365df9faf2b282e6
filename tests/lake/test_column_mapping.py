"""Which column names need Delta column mapping (no Spark session: the schema types only)."""

from pyspark.sql import types as T

from cdc_assets.lake.column_mapping import MODE, column_mapping_properties, refused_names


def test_names_delta_refuses_are_found_nested_too() -> None:
    image = T.StructType([T.StructField("id", T.IntegerType()), T.StructField("unit price (€)", T.StringType())])
    schema = T.StructType(
        [
            T.StructField("ok_name", T.StringType()),
            T.StructField("Größe", T.StringType()),  # non-ASCII is accepted
            T.StructField("after", image),
            T.StructField("tags", T.ArrayType(T.StructType([T.StructField("a=b", T.StringType())]))),
        ]
    )
    assert refused_names(schema) == ["after.unit price (€)", "tags.a=b"]
    assert column_mapping_properties(schema) == {MODE: "name"}


def test_ordinary_names_need_no_mapping() -> None:
    schema = T.StructType([T.StructField(n, T.StringType()) for n in ("id", "Order_Items", "Maß", "a-b", "x.y")])
    assert refused_names(schema) == [] and column_mapping_properties(schema) == {}
